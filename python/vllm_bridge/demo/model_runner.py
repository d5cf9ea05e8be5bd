"""The model runner: owns the model on its device and runs one forward pass per step the
way vLLM's GPU model runner does.

``execute_model(step)``:

1. updates the request states (finished requests leave, new ones get a KV region);
2. picks the padded size and CUDA-graph mode of the batch (:mod:`vllm_bridge.cudagraph_dispatch`);
3. calls :func:`~vllm_bridge.dp.coordinate_batch_across_dp` - **every DP rank calls it, every
   step, even with no tokens of its own** - which agrees on the token counts (padding),
   micro-batching and the CUDA-graph mode;
4. prepares the inputs (token ids, positions, KV slots, attention metadata) padded to the
   agreed count, builds the :class:`~vllm_bridge.forward_context.BatchDescriptor` and, when
   micro-batching, the micro-batch slices;
5. runs the model under ``set_forward_context`` with the attention metadata, slot mapping
   (per layer, or per micro-batch: :mod:`vllm_bridge.demo.forward_contexts`), DP counts,
   runtime mode, batch descriptor and micro-batch slices; the layers read them;
6. computes the logits of each request whose known tokens are now all computed, samples
   greedily, and returns them with the step's facts (:class:`StepOutput`, defined in
   :mod:`vllm_bridge.demo.step_output` and re-exported here, its public home).

CUDA graphs: the runtime mode is decided, agreed across ranks, padded for and carried in the
forward context and the batch descriptor exactly as vLLM does. ``load_model`` captures a
graph for every descriptor the dispatcher can return (:mod:`vllm_bridge.demo.graphs`; the
forward context of those passes: :func:`~vllm_bridge.demo.forward_contexts.capture_context`),
and each step replays the one its descriptor names; a step without one runs eagerly, and its
:class:`StepOutput` says which (``graph``, ``graph_reason``). Without CUDA the same
bookkeeping runs and the captured steps run their pieces eagerly (``graph="emulated"``).
"""

import time
from functools import partial

import torch

from vllm_bridge._checks import check_int
from vllm_bridge.config import VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.demo.graphs import ForwardInputs, GraphManager, GraphRun, runner_dispatcher
from vllm_bridge.demo.batch import InputBatch, RequestState, SchedulerStep, prepare_inputs
from vllm_bridge.demo.forward_contexts import capture_context, step_layer_metadata
from vllm_bridge.demo.requests import after_step, apply_step
from vllm_bridge.demo.sequential_ubatches import run_ubatches_sequentially
from vllm_bridge.demo.step_output import StepOutput
from vllm_bridge.demo.model import weights as weights_io
from vllm_bridge.demo.model.config import ModelConfig
from vllm_bridge.demo.model.transformer import MoETransformer
from vllm_bridge.dp import coordinate_batch_across_dp
from vllm_bridge.forward_context import BatchDescriptor, set_forward_context
from vllm_bridge.platforms import current_platform
from vllm_bridge.ubatch import maybe_create_ubatch_slices
from vllm_bridge.ubatch_wrapper import UBatchWrapper

__all__ = ["ModelRunner", "StepOutput"]


class ModelRunner:
    """Runs :class:`~vllm_bridge.demo.model.MoETransformer` for one DP rank.

    Args:
        vllm_config: Parallel settings (DP size and rank, expert parallelism,
            micro-batching) and CUDA-graph settings (mode, capture sizes).
        model_config: The model's shape; the weights loaded later must match it. ``None``:
            whatever shape the weights file records.
        device: Where the model lives; ``None``: CUDA when available, else CPU.
        max_num_reqs: Requests held at once (KV-cache regions).
        moe_chunk_size: Most tokens per rank in one DP chunk of an MoE layer.
        ubatch_overlap: When the ranks agree to micro-batch, run the micro-batches on two
            threads that overlap at the collectives (True) or one after the other (False;
            kept as the reference the overlapped run is compared with).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        model_config: ModelConfig | None = None,
        device: str | torch.device | None = None,
        max_num_reqs: int = 64,
        moe_chunk_size: int = 32,
        ubatch_overlap: bool = True,
    ) -> None:
        if not isinstance(vllm_config, VllmConfig):
            raise TypeError(f"vllm_config must be a VllmConfig, got {vllm_config!r}")
        if model_config is not None and not isinstance(model_config, ModelConfig):
            raise TypeError(f"model_config must be a ModelConfig or None, got {model_config!r}")
        check_int("max_num_reqs", max_num_reqs, minimum=1)
        check_int("moe_chunk_size", moe_chunk_size, minimum=1)
        if not isinstance(ubatch_overlap, bool):
            raise TypeError(f"ubatch_overlap must be a bool, got {ubatch_overlap!r}")
        self.ubatch_overlap = ubatch_overlap
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.model_config = model_config
        self.dp_size = self.parallel_config.data_parallel_size
        self.dp_rank = self.parallel_config.data_parallel_rank
        self.max_num_reqs = max_num_reqs
        self.moe_chunk_size = moe_chunk_size
        self.model: MoETransformer | None = None
        self.graphs: GraphManager | None = None
        self.ubatch_wrapper: UBatchWrapper | None = None
        # One dispatcher for the runner's life: its keys are the graphs there are (built
        # once, as vLLM's model runner does), and every step is dispatched through it.
        self.dispatcher = runner_dispatcher(vllm_config, max_num_reqs, self.dp_size)
        self.weights: weights_io.WeightsFile | None = None
        self.requests: dict[str, RequestState] = {}
        self._free_regions = list(range(max_num_reqs))

    @property
    def expert_parallel(self) -> bool:
        """Experts are sharded over the DP ranks."""
        return self.parallel_config.enable_expert_parallel and self.dp_size > 1

    # -- loading ---------------------------------------------------------------------------

    def load_model(self, path: str) -> weights_io.WeightsFile:
        """Read and check the weights file, build the model on the device, load this rank's
        shard strictly, allocate the KV caches and register the layers in the config.

        Raises:
            WeightsError: the file is unreadable, or not made for this runner's model.
        """
        if self.model is not None:
            raise RuntimeError("a model is loaded already; create a new runner to load another")
        info, state = weights_io.read_weights(path)
        if self.model_config is None:
            self.model_config = info.config
        if info.config != self.model_config:
            raise weights_io.WeightsError(
                f"weights file {path!r} was made for {info.config}, this runner's model is "
                f"{self.model_config}"
            )
        ep_size, ep_rank = (self.dp_size, self.dp_rank) if self.expert_parallel else (1, 0)
        state = weights_io.shard_state_dict(state, info.config, ep_size, ep_rank)
        with torch.device(self.device):
            model = MoETransformer(
                self.model_config,
                dp_size=self.dp_size,
                dp_rank=self.dp_rank,
                expert_parallel=self.expert_parallel,
                moe_chunk_size=self.moe_chunk_size,
            ).to(self.model_config.torch_dtype)
        weights_io.load_into(model, state)
        model.eval()
        slots = self.max_num_reqs * self.model_config.max_model_len
        compilation = self.vllm_config.compilation_config
        for name, layer in model.attention_layers().items():
            layer.bind_kv_cache(slots)
            compilation.static_forward_context[name] = layer
        compilation.static_all_moe_layers = model.moe_layer_names()
        self.model, self.weights = model, info
        self.graphs = GraphManager(model, self.device, partial(capture_context, self.vllm_config))
        # Runtime mode NONE: micro-batching needs DP > 1, and with DP the runner never runs
        # FULL graphs (the collectives go through gloo or the CPU with bounded waits: not
        # capturable), so this wrapper never captures. Its capture path has its own tests.
        self.ubatch_wrapper = UBatchWrapper(
            model, self.vllm_config, CUDAGraphMode.NONE, self.device
        )
        if compilation.cudagraph_mode is not CUDAGraphMode.NONE:
            self.graphs.capture(self.graph_descriptors())
        return info

    def _descriptor(self, padded: int, mode: CUDAGraphMode, uniform: bool) -> BatchDescriptor:
        """The key of a step of ``padded`` tokens under ``mode``, once the DP ranks agreed
        on both (the agreement may pad further or downgrade the mode): the dispatcher's
        own key for that size and mode, so the two never drift apart; the plain
        descriptor of that size when the dispatcher has no graph of that mode for it."""
        if mode is not CUDAGraphMode.NONE:
            got, key = self.dispatcher.dispatch(
                padded, uniform, disable_full=mode is not CUDAGraphMode.FULL
            )
            if got is mode:
                return key
        return BatchDescriptor(num_tokens=padded)

    def graph_descriptors(self) -> dict[BatchDescriptor, CUDAGraphMode]:
        """Every descriptor the dispatcher can return, with its mode: the graphs to capture
        (``CudagraphDispatcher.capture_descriptors``)."""
        return {
            descriptor: mode
            for mode, descriptors in self.dispatcher.capture_descriptors()
            for descriptor in descriptors
        }

    # -- one step --------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, step: SchedulerStep) -> StepOutput:
        """Run one step (see the module docstring); every DP rank must call it each step."""
        if not isinstance(step, SchedulerStep):
            raise TypeError(f"step must be a SchedulerStep, got {step!r}")
        if self.model is None or self.model_config is None:
            raise RuntimeError("no model loaded: call load_model(path) first")
        started = time.perf_counter()
        self._update_requests(step)
        scheduled = [(r, n) for r, n in step.num_scheduled_tokens.items() if n > 0]
        # Decodes first, then prefills (as vLLM orders a batch); ties by request id.
        scheduled.sort(key=lambda item: (item[1], item[0]))
        requests = [self.requests[r] for r, _ in scheduled]
        counts = [n for _, n in scheduled]
        num_tokens = sum(counts)
        uniform = bool(counts) and all(n == 1 for n in counts)
        configured = self.vllm_config.compilation_config
        mode, key = self.dispatcher.dispatch(num_tokens, uniform)
        padded = key.num_tokens
        should_ubatch, across, synced = coordinate_batch_across_dp(
            num_tokens_unpadded=num_tokens,
            allow_microbatching=self.parallel_config.enable_dbo,
            allow_dp_padding=configured.cudagraph_mode is not CUDAGraphMode.NONE,
            parallel_config=self.parallel_config,
            num_tokens_padded=padded,
            uniform_decode=uniform,
            num_scheduled_tokens_per_request=counts,
            cudagraph_mode=mode.value,
        )
        mode = CUDAGraphMode(synced)
        if across is not None:
            padded = int(across[self.dp_rank])
            if int(across.max()) == 0:
                return StepOutput(num_tokens_across_dp=across.tolist(), skipped=True)
        elif num_tokens == 0:
            return StepOutput(skipped=True)
        batch = prepare_inputs(
            requests, counts, padded, self.model_config.max_model_len, self.device
        )
        descriptor = self._descriptor(padded, mode, uniform)
        _, ubatch_slices = maybe_create_ubatch_slices(
            should_ubatch, counts, padded, max(len(counts), 1), self.parallel_config.num_ubatches
        )
        forward_start = time.perf_counter()
        ran = self._forward(batch, across, mode, descriptor, ubatch_slices)
        hidden = ran.hidden
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sampled = torch.argmax(logits, dim=-1).tolist()
        self._after_step(batch, sampled)
        if current_platform.synchronize is not None:
            current_platform.synchronize()
        now = time.perf_counter()
        return StepOutput(
            num_tokens=num_tokens,
            num_tokens_padded=padded,
            num_tokens_across_dp=across.tolist() if across is not None else None,
            num_reqs=len(requests),
            uniform_decode=uniform,
            should_ubatch=ubatch_slices is not None,
            ubatch_num_tokens=[s.num_tokens for s in ubatch_slices] if ubatch_slices else None,
            cudagraph_mode=mode.name,
            batch_descriptor=descriptor,
            moe_chunks=self._moe_chunks(across, padded, ubatch_slices),
            forward_ms=(now - forward_start) * 1e3,
            step_ms=(now - started) * 1e3,
            req_ids=batch.sample_req_ids,
            sampled_token_ids=sampled,
            logits=logits.cpu(),
            graph=ran.how,
            graph_reason=ran.reason,
            ubatch_run=self._ubatch_run(ubatch_slices),
        )

    def _ubatch_run(self, ubatch_slices: list | None) -> str | None:
        """How the micro-batches ran: as the wrapper reports it (set once its run succeeded)."""
        if ubatch_slices is None or not self.ubatch_overlap:
            return None if ubatch_slices is None else "sequential"
        return self.ubatch_wrapper.last_run if self.ubatch_wrapper is not None else None

    def _forward(
        self,
        batch: InputBatch,
        across: torch.Tensor | None,
        mode: CUDAGraphMode,
        descriptor: BatchDescriptor,
        ubatch_slices: list | None,
    ) -> GraphRun:
        attn, slots = step_layer_metadata(self.vllm_config, batch, ubatch_slices)
        with set_forward_context(
            attn,
            self.vllm_config,
            num_tokens=batch.num_tokens_padded,
            num_tokens_across_dp=across,
            cudagraph_runtime_mode=mode,
            batch_descriptor=descriptor,
            ubatch_slices=ubatch_slices,
            slot_mapping=slots,
        ):
            if ubatch_slices is None:
                inputs = ForwardInputs(batch.input_ids, batch.positions, batch.slot_mapping)
                return self.graphs.run(descriptor, mode, inputs)
            if not self.ubatch_overlap:
                hidden = run_ubatches_sequentially(
                    self.model, self.vllm_config, batch.input_ids, batch.positions
                )
                return GraphRun(hidden, "eager", "micro-batched (one after the other, eager)")
            hidden = self.ubatch_wrapper(input_ids=batch.input_ids, positions=batch.positions)
            return GraphRun(
                hidden, "eager", "micro-batched (two threads overlapping at the MoE collectives)"
            )

    def _moe_chunks(self, across: torch.Tensor | None, padded: int, ubatches: list | None) -> int:
        """DP chunks one MoE layer walked in this step (summed over micro-batches)."""
        if across is None:
            return 0
        sizes = [u.num_tokens for u in ubatches] if ubatches else [int(across.max())]
        return sum(max(1, -(-n // self.moe_chunk_size)) for n in sizes)

    # -- request state ---------------------------------------------------------------------

    def _update_requests(self, step: SchedulerStep) -> None:
        """Apply finished and new requests, every check first (:func:`apply_step`)."""
        apply_step(
            self.requests,
            self._free_regions,
            step,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.model_config.max_model_len,
            max_num_reqs=self.max_num_reqs,
        )

    def _after_step(self, batch: InputBatch, sampled: list[int]) -> None:
        after_step(self.requests, batch, sampled)

    def request_tokens(self, req_id: str) -> list[int]:
        """Every known token of a running request: its prompt, then the sampled ones."""
        state = self.requests.get(req_id)
        if state is None:
            raise ValueError(f"request {req_id!r} is not running")
        return list(state.token_ids)
