"""The minimal configuration the forward-context system reads.

Every config is default-constructible (one rank, no DP, no CUDA graphs) and validates its
fields when constructed, raising ``TypeError``/``ValueError`` naming the bad value.
"""

from dataclasses import dataclass, field
from typing import Any

from vllm_bridge._checks import check_bool, check_int, check_optional_bool, check_optional_int
from vllm_bridge.cudagraph import CUDAGraphMode, cudagraph_mode_from

__all__ = ["ParallelConfig", "CompilationConfig", "SchedulerConfig", "LoRAConfig", "VllmConfig"]


@dataclass
class ParallelConfig:
    """Parallelism settings: data parallelism, expert parallelism and micro-batching.

    Attributes:
        data_parallel_size: Number of data-parallel (DP) ranks; 1 means no DP.
        data_parallel_rank: This process's DP rank, ``0 <= rank < data_parallel_size``.
        is_moe_model: Whether the model is mixture-of-experts. ``None`` means unknown and is
            treated like ``True`` (DP metadata is built), as only ``False`` opts out.
        enable_expert_parallel: Shard MoE experts across ranks instead of replicating them.
        enable_dbo: Micro-batching switch (dual batch overlap): split a batch into
            ``num_ubatches`` micro-batches when every DP rank agrees.
        dbo_decode_token_threshold: A uniform-decode batch is micro-batched only from this
            many tokens.
        dbo_prefill_token_threshold: A batch with prefills is micro-batched only from this
            many tokens.
        num_ubatches: Number of micro-batches a batch is split into (at least 2).
        disable_nccl_for_dp_synchronization: On CUDA, run the DP all_reduce over the CPU
            (gloo) group instead of NCCL, avoiding a device sync point.
    """

    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    is_moe_model: bool | None = None
    enable_expert_parallel: bool = False
    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    num_ubatches: int = 2
    disable_nccl_for_dp_synchronization: bool = False

    def __post_init__(self) -> None:
        check_int("data_parallel_size", self.data_parallel_size, minimum=1)
        check_int("data_parallel_rank", self.data_parallel_rank, minimum=0)
        if self.data_parallel_rank >= self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank must be < data_parallel_size "
                f"({self.data_parallel_size}), got {self.data_parallel_rank}"
            )
        check_optional_bool("is_moe_model", self.is_moe_model)
        check_bool("enable_expert_parallel", self.enable_expert_parallel)
        check_bool("enable_dbo", self.enable_dbo)
        check_int("dbo_decode_token_threshold", self.dbo_decode_token_threshold, minimum=1)
        check_int("dbo_prefill_token_threshold", self.dbo_prefill_token_threshold, minimum=1)
        check_int("num_ubatches", self.num_ubatches, minimum=2)
        check_bool("disable_nccl_for_dp_synchronization", self.disable_nccl_for_dp_synchronization)


@dataclass
class CompilationConfig:
    """Compilation and CUDA-graph settings.

    Attributes:
        cudagraph_mode: The configured CUDA-graph mode (any member, including the
            two-routine ones). A member name such as ``"full_and_piecewise"`` is accepted
            and converted.
        cudagraph_capture_sizes: Batch sizes (token counts) to capture graphs for; stored
            sorted ascending, without duplicates.
        max_cudagraph_capture_size: Largest size captured; defaults to the largest capture
            size (or ``None`` when there are none). Must not be below it.
        static_forward_context: Layers that are not compiled, by name; every forward
            context gets it as ``no_compile_layers``.
        static_all_moe_layers: MoE layer names in call order; every forward context gets
            it as ``all_moe_layers``.
        cudagraph_specialize_lora: With LoRA configured, capture graphs both without LoRA
            and per active-adapter count; when False, only graphs with LoRA active (for
            ``max_loras + 1`` adapters) are captured (vLLM's field, default True).
    """

    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    cudagraph_capture_sizes: list[int] = field(default_factory=list)
    max_cudagraph_capture_size: int | None = None
    static_forward_context: dict[str, Any] = field(default_factory=dict)
    static_all_moe_layers: list[str] = field(default_factory=list)
    cudagraph_specialize_lora: bool = True

    def __post_init__(self) -> None:
        check_bool("cudagraph_specialize_lora", self.cudagraph_specialize_lora)
        self.cudagraph_mode = cudagraph_mode_from(self.cudagraph_mode, "cudagraph_mode")
        sizes = self.cudagraph_capture_sizes
        if not isinstance(sizes, (list, tuple)):
            raise TypeError(f"cudagraph_capture_sizes must be a list of ints, got {sizes!r}")
        for size in sizes:
            check_int("cudagraph_capture_sizes entry", size, minimum=1)
        self.cudagraph_capture_sizes = sorted(set(sizes))
        check_optional_int("max_cudagraph_capture_size", self.max_cudagraph_capture_size, minimum=1)
        largest = self.cudagraph_capture_sizes[-1] if self.cudagraph_capture_sizes else None
        if self.max_cudagraph_capture_size is None:
            self.max_cudagraph_capture_size = largest
        elif largest is not None and self.max_cudagraph_capture_size < largest:
            raise ValueError(
                f"max_cudagraph_capture_size ({self.max_cudagraph_capture_size}) is below "
                f"the largest cudagraph_capture_sizes entry ({largest})"
            )
        moe_layers = self.static_all_moe_layers
        if not isinstance(moe_layers, list) or not all(isinstance(n, str) for n in moe_layers):
            raise TypeError(f"static_all_moe_layers must be a list of str, got {moe_layers!r}")
        if not isinstance(self.static_forward_context, dict):
            raise TypeError(
                f"static_forward_context must be a dict, got {self.static_forward_context!r}"
            )


@dataclass
class SchedulerConfig:
    """Scheduler limits the CUDA-graph dispatcher reads.

    Attributes:
        max_num_seqs: The most requests one step schedules. FULL decode graphs are captured
            only for batches of at most this many requests (vLLM's class default, 128).
    """

    max_num_seqs: int = 128

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, minimum=1)


@dataclass
class LoRAConfig:
    """LoRA settings that decide which CUDA graphs are captured for LoRA batches.

    Attributes:
        max_loras: The most distinct LoRA adapters active in one batch (vLLM's default, 1).
        specialize_active_lora: Capture separate graphs per active-adapter count (powers of
            two up to ``max_loras``, and ``max_loras + 1``) instead of one graph sized for
            ``max_loras + 1`` (vLLM's default, False).
    """

    max_loras: int = 1
    specialize_active_lora: bool = False

    def __post_init__(self) -> None:
        check_int("max_loras", self.max_loras, minimum=1)
        check_bool("specialize_active_lora", self.specialize_active_lora)


@dataclass
class VllmConfig:
    """The configs a forward pass reads, bundled.

    Attributes:
        parallel_config: Parallelism settings.
        compilation_config: Compilation and CUDA-graph settings.
        scheduler_config: Scheduler limits (``max_num_seqs``).
        lora_config: LoRA settings; ``None`` when LoRA is off (vLLM's default).
    """

    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora_config: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.parallel_config, ParallelConfig):
            raise TypeError(
                f"parallel_config must be a ParallelConfig, got {self.parallel_config!r}"
            )
        if not isinstance(self.compilation_config, CompilationConfig):
            raise TypeError(
                f"compilation_config must be a CompilationConfig, got {self.compilation_config!r}"
            )
        if not isinstance(self.scheduler_config, SchedulerConfig):
            raise TypeError(
                f"scheduler_config must be a SchedulerConfig, got {self.scheduler_config!r}"
            )
        if self.lora_config is not None and not isinstance(self.lora_config, LoRAConfig):
            raise TypeError(f"lora_config must be a LoRAConfig or None, got {self.lora_config!r}")
