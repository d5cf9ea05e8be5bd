"""The forward context: per-forward-pass metadata that model layers read without plumbing.

A model runner wraps each forward pass in :func:`set_forward_context`; code deep inside the
model calls :func:`get_forward_context` for the attention metadata, the DP token counts
(:class:`DPMetadata`), the CUDA-graph runtime mode and :class:`BatchDescriptor`, and the
micro-batch slices.

The current context lives in a :class:`contextvars.ContextVar`, so every thread, and every
bridge session (each runs in its own ``contextvars.Context``), has its own: one never sees
another's. ``_forward_context`` (a module attribute) reads the current one, or ``None``.

Batch-size tracking (see :mod:`vllm_bridge.batchsize`) is exposed here as the module
attributes ``track_batchsize``, ``batchsize_logging_interval``, ``batchsize_forward_time``,
``forward_start_time`` and ``last_logging_time`` (read live), and the functions
:func:`get_batchsize_stats`, :func:`configure_batchsize_tracking` and
:func:`reset_batchsize_stats`.
"""

import logging
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_bridge import batchsize as _batchsize
from vllm_bridge._checks import (
    as_count_tensor,
    check_bool,
    check_instance,
    check_int,
    check_list_of,
    check_optional_int,
    is_count_tensor,
)
from vllm_bridge.config import ParallelConfig, VllmConfig
from vllm_bridge.cudagraph import RUNTIME_MODES, CUDAGraphMode, cudagraph_mode_from
from vllm_bridge.dp import coordinate_batch_across_dp
from vllm_bridge.platforms import current_platform
from vllm_bridge.ubatch import UBatchSlice, UBatchSlices

__all__ = [
    "BatchDescriptor",
    "DPMetadata",
    "ForwardContext",
    "UBatchSlices",
    "batchsize_forward_time",
    "batchsize_logging_interval",
    "configure_batchsize_tracking",
    "coordinate_batch_across_dp",
    "create_forward_context",
    "current_platform",
    "forward_start_time",
    "get_batchsize_stats",
    "get_forward_context",
    "init_logger",
    "is_forward_context_available",
    "last_logging_time",
    "override_forward_context",
    "reset_batchsize_stats",
    "set_forward_context",
    "track_batchsize",
]

logger = logging.getLogger(__name__)

#: Batch-size tracking state, read live from vllm_bridge.batchsize.
_TRACKING_ATTRS = (
    "track_batchsize",
    "batchsize_logging_interval",
    "batchsize_forward_time",
    "forward_start_time",
    "last_logging_time",
)


# The batch-size functions of the forward-context API are defined here, not re-exported
# from vllm_bridge.batchsize: a caller may call only code defined in an allow-listed module
# (docs/SECURITY.md), and vllm_bridge.batchsize is not one.


def configure_batchsize_tracking(interval_s: float) -> None:
    """Turn tracking on (``interval_s >= 0``, seconds between log lines) or off (< 0)."""
    _batchsize.configure_batchsize_tracking(interval_s)


def reset_batchsize_stats() -> None:
    """Forget every recorded forward time and the time of the last log line."""
    _batchsize.reset_batchsize_stats()


def get_batchsize_stats(min_count: int = 2) -> list[tuple[int | None, int, float]]:
    """The recorded stats: ``(batchsize, count, median_time_ms)`` sorted by count, descending.

    Args:
        min_count: Leave out batch sizes recorded fewer times than this (the log leaves out
            sizes seen once).
    """
    return _batchsize.get_batchsize_stats(min_count)


def init_logger(name: str) -> logging.Logger:
    """The logger called ``name`` (a standard :mod:`logging` logger)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {name!r}")
    return logging.getLogger(name)


@dataclass(frozen=True)
class BatchDescriptor:
    """Describes a padded batch for CUDA-graph dispatch; immutable and hashable.

    Two batches with equal descriptors can replay the same CUDA graph, so the descriptor is
    used as a dictionary key. Keep it minimal: only what distinguishes one graph from another.

    Attributes:
        num_tokens: Number of (padded) tokens in the batch.
        num_reqs: Number of requests in the batch; ``None`` for PIECEWISE graphs, which
            handle any number of requests.
        uniform: True when every request in the batch has the same number of tokens.
        has_lora: True when the batch has active LoRA adapters.
        num_active_loras: Number of distinct active LoRA adapters in the batch (separate
            graphs may be captured per count).
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    has_lora: bool = False
    num_active_loras: int = 0

    def __post_init__(self) -> None:
        reqs, loras = self.num_reqs, self.num_active_loras
        if (  # the common, valid case in exact-type tests; the checks below name errors
            type(self.num_tokens) is int
            and self.num_tokens >= 0
            and (reqs is None or (type(reqs) is int and reqs >= 0))
            and type(self.uniform) is bool
            and type(self.has_lora) is bool
            and type(loras) is int
            and loras >= 0
        ):
            return
        check_int("BatchDescriptor.num_tokens", self.num_tokens, minimum=0)
        check_optional_int("BatchDescriptor.num_reqs", self.num_reqs, minimum=0)
        check_bool("BatchDescriptor.uniform", self.uniform)
        check_bool("BatchDescriptor.has_lora", self.has_lora)
        check_int("BatchDescriptor.num_active_loras", self.num_active_loras, minimum=0)

    def relax_for_mixed_batch_cudagraphs(self) -> "BatchDescriptor":
        """A descriptor for the same token count that PIECEWISE (mixed-batch) graphs accept.

        Drops ``num_reqs`` and ``uniform`` (reset to their defaults) and keeps the LoRA
        fields, which still select the graph.
        """
        return BatchDescriptor(
            num_tokens=self.num_tokens,
            num_reqs=None,
            uniform=False,
            has_lora=self.has_lora,
            num_active_loras=self.num_active_loras,
        )


def _compute_sp_num_tokens(
    num_tokens_across_dp_cpu: torch.Tensor | list[int], sequence_parallel_size: int
) -> list[int]:
    """Per sequence-parallel rank token counts: each DP rank's count split over ``sp`` ranks.

    Each DP rank's count is ceil-divided by ``sequence_parallel_size`` and repeated that many
    times, e.g. ``[5, 3]`` with sp 2 gives ``[3, 3, 2, 2]``.
    """
    counts = as_count_tensor("num_tokens_across_dp_cpu", num_tokens_across_dp_cpu)
    check_int("sequence_parallel_size", sequence_parallel_size, minimum=1)
    per_sp = (counts + sequence_parallel_size - 1) // sequence_parallel_size
    return per_sp.repeat_interleave(sequence_parallel_size).tolist()


def _compute_chunked_local_num_tokens(
    num_tokens_across_dp_cpu: torch.Tensor | list[int],
    sequence_parallel_size: int,
    max_num_tokens: int,
    chunk_idx: int,
) -> list[int]:
    """Per-rank token counts of chunk ``chunk_idx`` of at most ``max_num_tokens`` tokens.

    For each sequence-parallel rank (see :func:`_compute_sp_num_tokens`) the chunk holds
    ``min(max_num_tokens, tokens left)``, and never fewer than 1, so a rank that has run out
    keeps stepping in lockstep with the others.
    """
    check_int("max_num_tokens", max_num_tokens, minimum=1)
    check_int("chunk_idx", chunk_idx, minimum=0)
    sp_tokens = _compute_sp_num_tokens(num_tokens_across_dp_cpu, sequence_parallel_size)
    consumed = max_num_tokens * chunk_idx
    return [max(1, min(max_num_tokens, tokens - consumed)) for tokens in sp_tokens]


@dataclass
class DPMetadata:
    """Data-parallel token counts of one forward pass.

    Attributes:
        max_tokens_across_dp_cpu: The largest count over the DP ranks (0-d CPU tensor).
        num_tokens_across_dp_cpu: Every DP rank's token count (1-D CPU tensor).
        local_sizes: Per-rank sizes of the current chunk; set only inside
            :meth:`chunked_sizes` / :meth:`sp_local_sizes`, ``None`` elsewhere.
    """

    max_tokens_across_dp_cpu: torch.Tensor
    num_tokens_across_dp_cpu: torch.Tensor
    local_sizes: list[int] | None = None

    def __post_init__(self) -> None:
        counts, most = self.num_tokens_across_dp_cpu, self.max_tokens_across_dp_cpu
        if not is_count_tensor(counts):
            raise TypeError(
                "num_tokens_across_dp_cpu must be a 1-D integer tensor, got "
                f"{counts!r:.100}"
            )
        if not isinstance(most, torch.Tensor) or most.numel() != 1:
            raise TypeError(
                f"max_tokens_across_dp_cpu must be a one-element tensor, got {most!r:.100}"
            )
        if self.local_sizes is not None:
            check_list_of("local_sizes", self.local_sizes, int)

    @staticmethod
    def make(
        parallel_config: ParallelConfig,
        num_tokens: int,
        num_tokens_across_dp_cpu: torch.Tensor | list[int],
    ) -> "DPMetadata":
        """Build DP metadata for this rank's ``num_tokens`` and every rank's counts.

        Raises:
            ValueError: DP is off, the model is marked non-MoE, the counts have the wrong
                length, or this rank's entry differs from ``num_tokens``.
        """
        check_instance("parallel_config", parallel_config, ParallelConfig)
        check_int("num_tokens", num_tokens, minimum=0)
        if num_tokens_across_dp_cpu is None:
            raise ValueError("num_tokens_across_dp_cpu is required, got None")
        if parallel_config.data_parallel_size <= 1:
            raise ValueError(
                "DPMetadata needs data_parallel_size > 1, "
                f"got {parallel_config.data_parallel_size}"
            )
        if parallel_config.is_moe_model is False:
            raise ValueError("DPMetadata is only built for MoE models; is_moe_model is False")
        counts = as_count_tensor("num_tokens_across_dp_cpu", num_tokens_across_dp_cpu)
        dp_size = parallel_config.data_parallel_size
        dp_rank = parallel_config.data_parallel_rank
        values = counts.tolist()
        if len(values) != dp_size:
            raise ValueError(
                f"num_tokens_across_dp_cpu has {len(values)} entries "
                f"({values}) but data_parallel_size is {dp_size}"
            )
        if values[dp_rank] != num_tokens:
            raise ValueError(
                f"num_tokens_across_dp_cpu[{dp_rank}] is {values[dp_rank]} "
                f"but this rank's num_tokens is {num_tokens}"
            )
        return DPMetadata(torch.max(counts), counts)

    @contextmanager
    def chunked_sizes(
        self, sequence_parallel_size: int, max_chunk_size_per_rank: int, chunk_idx: int
    ) -> Iterator[list[int]]:
        """Set ``local_sizes`` to every rank's token count in chunk ``chunk_idx``, inside only.

        For chunked execution each rank splits its tokens into chunks of at most
        ``max_chunk_size_per_rank``; ranks with fewer tokens still step through every chunk
        (with a count of at least 1) so that all ranks stay in lockstep. ``local_sizes``
        is reset to ``None`` on exit, also when the body raises.

        Args:
            sequence_parallel_size: Sequence-parallel size (attention TP with MoE EP splits
                each DP rank's tokens over this many ranks).
            max_chunk_size_per_rank: The most tokens one rank processes in a chunk.
            chunk_idx: Which chunk.

        Yields:
            The per-rank sizes (also in ``self.local_sizes``).
        """
        self.local_sizes = _compute_chunked_local_num_tokens(
            self.num_tokens_across_dp_cpu,
            sequence_parallel_size,
            max_chunk_size_per_rank,
            chunk_idx,
        )
        try:
            yield self.local_sizes
        finally:
            self.local_sizes = None

    @contextmanager
    def sp_local_sizes(self, sequence_parallel_size: int) -> Iterator[list[int]]:
        """Like :meth:`chunked_sizes` without chunking: each sequence-parallel rank's count."""
        self.local_sizes = _compute_sp_num_tokens(
            self.num_tokens_across_dp_cpu, sequence_parallel_size
        )
        try:
            yield self.local_sizes
        finally:
            self.local_sizes = None

    def get_chunk_sizes_across_dp_rank(self) -> list[int] | None:
        """The current chunk's per-rank sizes; only valid inside a sizes context.

        Raises:
            RuntimeError: called outside :meth:`chunked_sizes` / :meth:`sp_local_sizes`.
        """
        if self.local_sizes is None:
            raise RuntimeError(
                "local_sizes is only set inside DPMetadata.chunked_sizes(...) or "
                "DPMetadata.sp_local_sizes(...)"
            )
        return self.local_sizes

    def cu_tokens_across_sp(self, sp_size: int) -> torch.Tensor:
        """Cumulative token counts over the DP x sequence-parallel ranks.

        With ``sp_size == 1`` this is the running sum of the DP ranks' counts.
        """
        return torch.cumsum(
            torch.tensor(_compute_sp_num_tokens(self.num_tokens_across_dp_cpu, sp_size)),
            dim=0,
        )


@dataclass
class ForwardContext:
    """Everything a forward pass's layers may need, set for the duration of the pass.

    Attributes:
        no_compile_layers: Layers not compiled, by name (the config's
            ``static_forward_context``).
        attn_metadata: Attention metadata: one dict from layer name to metadata, or a
            list of such dicts, one per micro-batch; ``None`` for dummy runs.
        slot_mapping: KV-cache slot mapping by layer name (or a list per micro-batch).
        virtual_engine: Index of the virtual engine (pipeline stage copy) running the pass.
        dp_metadata: DP token counts when DP is on for an MoE model.
        cudagraph_runtime_mode: NONE, PIECEWISE or FULL (never a two-routine mode).
        batch_descriptor: Key of the CUDA graph to replay, if any.
        ubatch_slices: Micro-batch slices when the batch is micro-batched.
        skip_compiled: Run the model's plain ``forward`` instead of the compiled one.
        all_moe_layers: MoE layer names in call order, so custom ops need not bake names
            into compiled graphs; they take the next one at ``moe_layer_index``.
        moe_layer_index: Index of the next MoE layer name to hand out.
        additional_kwargs: Platform-specific extras.
    """

    no_compile_layers: dict[str, Any]
    attn_metadata: Any
    slot_mapping: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]
    virtual_engine: int
    dp_metadata: DPMetadata | None = None
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor | None = None
    ubatch_slices: UBatchSlices | None = None
    skip_compiled: bool = False
    all_moe_layers: list[str] | None = None
    moe_layer_index: int = 0
    additional_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        mode = self.cudagraph_runtime_mode
        if mode.__class__ is not CUDAGraphMode:
            mode = self.cudagraph_runtime_mode = cudagraph_mode_from(mode, "cudagraph_runtime_mode")
        if mode not in RUNTIME_MODES:
            raise ValueError(
                f"Invalid cudagraph runtime mode: {mode.name}; a forward pass runs under "
                "NONE, PIECEWISE or FULL"
            )
        check_instance("no_compile_layers", self.no_compile_layers, dict)
        # Cheap exact-type tests first (this runs on every forward pass); the full check
        # only runs to raise the error.
        if type(self.virtual_engine) is not int or self.virtual_engine < 0:
            check_int("virtual_engine", self.virtual_engine, minimum=0)
        check_instance("dp_metadata", self.dp_metadata, DPMetadata, optional=True)
        check_instance("batch_descriptor", self.batch_descriptor, BatchDescriptor, optional=True)
        check_list_of("ubatch_slices", self.ubatch_slices, UBatchSlice, optional=True)
        if type(self.skip_compiled) is not bool:
            check_bool("skip_compiled", self.skip_compiled)
        if type(self.moe_layer_index) is not int or self.moe_layer_index < 0:
            check_int("moe_layer_index", self.moe_layer_index, minimum=0)
        check_instance("additional_kwargs", self.additional_kwargs, dict)
        slots = self.slot_mapping
        if type(slots) is not dict and not (
            isinstance(slots, list) and all(isinstance(m, dict) for m in slots)
        ):
            raise TypeError(
                "slot_mapping must be a dict (layer name -> tensor) or a list of them, one "
                f"per micro-batch, got {slots!r:.100}"
            )
        if self.all_moe_layers is not None:
            check_list_of("all_moe_layers", self.all_moe_layers, str)


# The current forward context of this thread / contextvars.Context (None: none set).
_forward_context_var: ContextVar[ForwardContext | None] = ContextVar(
    "vllm_bridge_forward_context", default=None
)

# The live module attributes that __getattr__ below serves, declared with their types
# (annotations only: the names stay unbound, so every read goes through __getattr__).
_forward_context: ForwardContext | None
track_batchsize: bool
batchsize_logging_interval: float
batchsize_forward_time: defaultdict[int | None, list[float]]
forward_start_time: float
last_logging_time: float


def __getattr__(name: str) -> Any:
    # Live module attributes: the current context (as vLLM's `_forward_context` global)
    # and the batch-size tracking state.
    if name == "_forward_context":
        return _forward_context_var.get()
    if name in _TRACKING_ATTRS:
        return getattr(_batchsize, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "_forward_context", *_TRACKING_ATTRS])


def get_forward_context() -> ForwardContext:
    """Get the current forward context.

    Raises:
        RuntimeError: no forward context is set in this thread / session.
    """
    context = _forward_context_var.get()
    if context is None:
        raise RuntimeError(
            "Forward context is not set. "
            "Please use `set_forward_context` to set the forward context."
        )
    return context


def is_forward_context_available() -> bool:
    """True when a forward context is set in this thread / session."""
    return _forward_context_var.get() is not None


def create_forward_context(
    attn_metadata: Any,
    vllm_config: VllmConfig,
    virtual_engine: int = 0,
    dp_metadata: DPMetadata | None = None,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
    ubatch_slices: UBatchSlices | None = None,
    slot_mapping: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]] | None = None,
    additional_kwargs: dict[str, Any] | None = None,
    skip_compiled: bool = False,
) -> ForwardContext:
    """Build a ForwardContext (without setting it) from the config and this pass's values.

    ``no_compile_layers`` and ``all_moe_layers`` come from
    ``vllm_config.compilation_config``; ``slot_mapping`` and ``additional_kwargs`` default
    to empty dicts.

    Raises:
        TypeError / ValueError: a bad argument, including a runtime mode other than NONE,
            PIECEWISE or FULL.
    """
    check_instance("vllm_config", vllm_config, VllmConfig)
    compilation = vllm_config.compilation_config
    return ForwardContext(
        no_compile_layers=compilation.static_forward_context,
        attn_metadata=attn_metadata,
        slot_mapping=slot_mapping if slot_mapping is not None else {},
        virtual_engine=virtual_engine,
        dp_metadata=dp_metadata,
        cudagraph_runtime_mode=cudagraph_runtime_mode,
        batch_descriptor=batch_descriptor,
        ubatch_slices=ubatch_slices,
        skip_compiled=skip_compiled,
        all_moe_layers=compilation.static_all_moe_layers,
        additional_kwargs=additional_kwargs if additional_kwargs is not None else {},
    )


@contextmanager
def override_forward_context(forward_context: ForwardContext | None) -> Iterator[None]:
    """A context manager that overrides the current forward context.

    This is used to override the forward context for a specific forward pass. ``None``
    clears it. The previous context comes back on exit, also when the body raises.
    """
    check_instance("forward_context", forward_context, ForwardContext, optional=True)
    previous = _forward_context_var.get()
    _forward_context_var.set(forward_context)
    try:
        yield
    finally:
        _forward_context_var.set(previous)


def _make_dp_metadata(
    vllm_config: VllmConfig,
    num_tokens: int | None,
    num_tokens_across_dp: torch.Tensor | list[int] | None,
    ubatch_slices: UBatchSlices | None,
) -> DPMetadata:
    """DP metadata for this pass, running the DP coordination when counts are not given."""
    parallel_config = vllm_config.parallel_config
    if num_tokens_across_dp is None:
        # Coordinate here; DP padding and micro-batching are both off in this path.
        if ubatch_slices is not None:
            raise ValueError(
                "ubatch_slices needs num_tokens_across_dp (from coordinate_batch_across_dp)"
            )
        if num_tokens is None:
            raise ValueError(
                "num_tokens is required when DP is on and num_tokens_across_dp is None"
            )
        _, num_tokens_across_dp, _ = coordinate_batch_across_dp(
            num_tokens_unpadded=num_tokens,
            allow_microbatching=False,
            allow_dp_padding=False,
            parallel_config=parallel_config,
        )
    return DPMetadata.make(parallel_config, num_tokens or 0, num_tokens_across_dp)


@contextmanager
def set_forward_context(
    attn_metadata: Any,
    vllm_config: VllmConfig,
    virtual_engine: int = 0,
    num_tokens: int | None = None,
    num_tokens_across_dp: torch.Tensor | list[int] | None = None,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
    ubatch_slices: UBatchSlices | None = None,
    slot_mapping: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]] | None = None,
    skip_compiled: bool = False,
) -> Iterator[None]:
    """A context manager that stores the current forward context,
    can be attention metadata, etc.
    Here we can inject common logic for every model forward pass.

    On entry: when DP is on (``data_parallel_size > 1``) for a model not marked non-MoE and
    the pass has attention metadata or ``num_tokens``, builds :class:`DPMetadata` from
    ``num_tokens_across_dp``, or, when that is ``None``, from one
    :func:`coordinate_batch_across_dp` round (no padding, no micro-batching; every DP rank
    must enter too). When a CUDA-graph mode is set with ``num_tokens`` and no
    ``batch_descriptor``, uses ``BatchDescriptor(num_tokens)``. Then sets the context for
    this thread / session. On exit (also on error) restores the previous context and, with
    batch-size tracking on and attention metadata given, records the pass's time.
    """
    check_instance("vllm_config", vllm_config, VllmConfig)
    if num_tokens is not None and (type(num_tokens) is not int or num_tokens < 0):
        check_optional_int("num_tokens", num_tokens, minimum=0)
    if cudagraph_runtime_mode.__class__ is not CUDAGraphMode:
        cudagraph_runtime_mode = cudagraph_mode_from(
            cudagraph_runtime_mode, "cudagraph_runtime_mode"
        )
    tracking = _batchsize.track_batchsize and attn_metadata is not None
    start = _batchsize.begin() if tracking else 0.0

    dp_metadata = None
    parallel_config = vllm_config.parallel_config
    if (
        parallel_config.data_parallel_size > 1
        and parallel_config.is_moe_model is not False
        and (attn_metadata is not None or num_tokens is not None)
    ):
        dp_metadata = _make_dp_metadata(
            vllm_config, num_tokens, num_tokens_across_dp, ubatch_slices
        )

    # No harm in a default descriptor: a wrapper without a matching graph falls through.
    if cudagraph_runtime_mode is not CUDAGraphMode.NONE and num_tokens is not None:
        batch_descriptor = batch_descriptor or BatchDescriptor(num_tokens=num_tokens)

    additional_kwargs = current_platform.set_additional_forward_context(
        attn_metadata=attn_metadata,
        vllm_config=vllm_config,
        virtual_engine=virtual_engine,
        dp_metadata=dp_metadata,
        num_tokens=num_tokens,
        num_tokens_across_dp=num_tokens_across_dp,
        cudagraph_runtime_mode=cudagraph_runtime_mode,
        batch_descriptor=batch_descriptor,
        ubatch_slices=ubatch_slices,
    )
    context = create_forward_context(
        attn_metadata,
        vllm_config,
        virtual_engine,
        dp_metadata,
        cudagraph_runtime_mode,
        batch_descriptor,
        ubatch_slices,
        slot_mapping,
        additional_kwargs,
        skip_compiled,
    )
    previous = _forward_context_var.get()
    _forward_context_var.set(context)
    try:
        yield
    finally:
        _forward_context_var.set(previous)
        if tracking:
            _batchsize.end(num_tokens, start)
