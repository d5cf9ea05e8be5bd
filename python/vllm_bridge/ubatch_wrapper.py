"""UBatchWrapper: a micro-batched forward pass, each micro-batch on its own thread, the two
taking turns at the communication points (as vLLM's ``gpu_ubatch_wrapper``).

``UBatchWrapper(runnable, vllm_config, runtime_mode, device)`` is called like the model
inside a forward context. Without ``ubatch_slices`` in the context it just calls the
runnable. With them it:

1. builds one forward context per micro-batch (its attention metadata and slot mapping,
   DP counts of the micro-batch's size) and slices the inputs (:meth:`_make_ubatch_metadata`,
   from the pieces in :mod:`vllm_bridge.ubatch_metadata`);
2. gives each micro-batch a :class:`~vllm_bridge.ubatching.UBatchContext`: compute and comm
   streams and a CPU wait event on CUDA, the same without streams on the CPU;
3. starts one thread per micro-batch; the threads and the main one meet at
   ``ready_barrier``, then the main thread hands the first turn to micro-batch 0 and joins
   them (:meth:`_run_ubatches`, in :mod:`vllm_bridge.ubatch_threads`). The threads hand
   over at the MoE layer's collectives (see :mod:`vllm_bridge.ubatching`), so one's
   all-gather / all-reduce overlaps the other's compute;
4. in FULL mode on CUDA, captures the micro-batched run in one CUDA graph the first time a
   token count is seen and replays it after (:meth:`_capture_ubatches`, in
   :mod:`vllm_bridge.ubatch_graphs`), keyed by the token count.

**Failure.** Every wait is bounded. A failing thread wakes its sibling, tells the other
DP ranks through the group's store, and every rank ends the step with that error; the DP
group is then drained on every rank (each collective posted anywhere gets its partner) so
the next step runs normally (why each part: :mod:`vllm_bridge.dp._ubatch_sync`). The main
thread can fail too (``KeyboardInterrupt``, the worker's cancel, raised while it waits for
the threads): it fails the run the same way (the threads stop before their next
collective), joins them, ends the run with the peers, and re-raises. A thread is declared
stuck only when no thread has made progress (a start, a hand-over, an end) for
``2 * timeout_s``: a long healthy step is never cut short. No thread outlives the call.
All of this is :mod:`vllm_bridge.ubatch_threads`; this module holds the wrapper itself:
its settings, the call (run eagerly, capture or replay) and the building of a run.

Differences from vLLM's: non-micro-batched runs are not wrapped in a CUDA-graph wrapper
here (the demo's graph manager does those); each micro-batch's DP metadata counts its own
tokens (the MoE layer chunks by it).

**What a replay refreshes.** A captured graph reads static copies of ``input_ids``,
``positions`` and ``inputs_embeds``, which each replay refills. Nothing else: the
attention metadata and slot mapping that the micro-batches' forward contexts carried at
capture stay those of capture time, so a replay is right only for a model whose
micro-batched pass reads nothing but those inputs (the tests' models). The demo's
:class:`~vllm_bridge.demo.model_runner.ModelRunner` never captures a micro-batched run
(its wrapper runs in NONE mode; with DP the demo's graphs are the graph manager's).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from vllm_bridge import dp
from vllm_bridge.config import VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import DPMetadata, get_forward_context
from vllm_bridge.sm_control import SMControlContextManager, create_sm_control
from vllm_bridge.ubatch_graphs import CUDAGraphMetaData, UBatchGraphs, ubatch_graph_action

# UbatchMetadata and make_ubatch_forward_contexts are this module's public names (and
# _ubatch_dp_metadata is imported from here by the tests): re-exported from their module.
from vllm_bridge.ubatch_metadata import (
    UbatchMetadata,
    _ubatch_dp_metadata,  # noqa: F401 - re-exported
    make_ubatch_forward_contexts,
    slice_model_inputs,
)
from vllm_bridge.ubatch_threads import UBatchThreads
from vllm_bridge.ubatching import UBatchRun, make_ubatch_contexts

__all__ = [
    "CUDAGraphMetaData",
    "SMControlContextManager",
    "UBatchWrapper",
    "UbatchMetadata",
    "make_ubatch_forward_contexts",
    "ubatch_graph_action",
]


class UBatchWrapper(UBatchThreads, UBatchGraphs):
    """Runs a micro-batched forward pass on two threads (see the module docstring).

    Args:
        runnable: The model: ``runnable(input_ids=..., positions=...)`` returns the
            hidden states of those tokens.
        vllm_config: The config (micro-batch count, compilation settings).
        runtime_mode: NONE, PIECEWISE or FULL: FULL lets micro-batched runs be captured.
        device: Where the model runs; streams and graphs only on CUDA.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        vllm_config: VllmConfig,
        runtime_mode: CUDAGraphMode,
        device: torch.device | str,
    ) -> None:
        if not callable(runnable):
            raise TypeError(f"runnable must be callable, got {runnable!r}")
        if not isinstance(vllm_config, VllmConfig):
            raise TypeError(f"vllm_config must be a VllmConfig, got {vllm_config!r}")
        if not isinstance(runtime_mode, CUDAGraphMode):
            raise TypeError(f"runtime_mode must be a CUDAGraphMode, got {runtime_mode!r}")
        self.runnable = runnable
        self.vllm_config = vllm_config
        self.compilation_config = vllm_config.compilation_config
        self.device = torch.device(device)
        self.use_cuda = self.device.type == "cuda"
        if self.use_cuda and self.device.index is None:
            # The threads call torch.cuda.set_device, which needs an index.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_ubatches = vllm_config.parallel_config.num_ubatches
        self.comm_stream = torch.cuda.Stream(device=self.device) if self.use_cuda else None
        # The micro-batch threads plus the main thread. Each run gets a fresh one (a thread
        # left over from a failed run can then never break the next run's); this is the
        # latest run's.
        self.ready_barrier = threading.Barrier(self.num_ubatches + 1)
        self.cudagraphs: dict[int, CUDAGraphMetaData] = {}
        self.graph_pool = None
        if runtime_mode is not CUDAGraphMode.NONE and self.use_cuda:
            self.graph_pool = torch.cuda.graph_pool_handle()
        self.sm_control = create_sm_control(vllm_config, self.device)
        #: How the last micro-batched call ran: "overlapped", "captured" or "replayed";
        #: set once it has succeeded (``None`` while it runs, after a failure, and after a
        #: call without micro-batches).
        self.last_run: str | None = None

    def __getattr__(self, key: str) -> Any:
        # Attributes of the runnable (only reached when the wrapper has none of that name).
        runnable = self.__dict__.get("runnable")
        if runnable is not None and hasattr(runnable, key):
            return getattr(runnable, key)
        raise AttributeError(
            f"Attribute {key} not exists in the runnable of {type(self).__name__}"
        )

    def unwrap(self) -> Callable[..., Any]:
        """The wrapped runnable."""
        return self.runnable

    @property
    def timeout_s(self) -> float:
        """The most one wait of a run may take: the DP group's timeout, or the default
        without a group."""
        info = dp.dp_group_info()
        return info.timeout_s if info is not None else dp.DEFAULT_TIMEOUT_S

    # -- the call ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = get_forward_context()
        slices = context.ubatch_slices
        self.last_run = None
        if slices is None:
            return self.runnable(*args, **kwargs)
        if args:
            raise TypeError("a micro-batched call takes keyword arguments only (input_ids=...)")
        num_tokens = sum(s.num_tokens for s in slices)
        action = ubatch_graph_action(
            context.cudagraph_runtime_mode, num_tokens, self.cudagraphs, self.use_cuda
        )
        if action == "replay":
            return self._replay(num_tokens, kwargs)
        metadata = self._make_ubatch_metadata(
            ubatch_slices=slices,
            attn_metadata=context.attn_metadata,
            input_ids=kwargs["input_ids"],
            positions=kwargs["positions"],
            inputs_embeds=kwargs.get("inputs_embeds"),
            intermediate_tensors=kwargs.get("intermediate_tensors"),
            compute_stream=torch.cuda.current_stream(self.device) if self.use_cuda else None,
            dp_metadata=context.dp_metadata,
            batch_descriptor=context.batch_descriptor,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            slot_mapping=context.slot_mapping,
        )
        with self.sm_control:
            if action == "capture":
                return self._capture_ubatches(metadata, self.runnable, kwargs)
            out = self._run_ubatches(metadata, self.runnable)
            self.last_run = "overlapped"
            return out

    # -- metadata ----------------------------------------------------------------------------

    def _make_ubatch_metadata(
        self,
        ubatch_slices: list,
        attn_metadata: Any,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None,
        intermediate_tensors: Any | None,
        compute_stream: Any,
        dp_metadata: DPMetadata | None,
        batch_descriptor: Any,
        cudagraph_runtime_mode: CUDAGraphMode,
        slot_mapping: Any = None,
    ) -> list[UbatchMetadata]:
        """One forward context and input slice per micro-batch. ``attn_metadata`` and
        ``slot_mapping`` are lists with one entry per micro-batch (or ``None``).

        Raises:
            ValueError: not one slice per configured micro-batch (``num_ubatches``: the
                threads the run starts), or ``attn_metadata`` / ``slot_mapping`` not one
                entry per slice.
        """
        # The seed's contract: one thread per configured micro-batch, all meeting at a
        # barrier of num_ubatches + 1. A different slice count is a caller's mistake
        # (maybe_create_ubatch_slices makes num_ubatches slices); refuse it here rather
        # than start threads the barrier was not sized for.
        if len(ubatch_slices) != self.num_ubatches:
            raise ValueError(
                f"a micro-batched pass needs one slice per micro-batch: got "
                f"len(ubatch_slices) = {len(ubatch_slices)}, but num_ubatches = "
                f"{self.num_ubatches}"
            )
        forward_contexts = make_ubatch_forward_contexts(
            self.vllm_config,
            ubatch_slices,
            attn_metadata,
            slot_mapping,
            dp_metadata,
            batch_descriptor,
            cudagraph_runtime_mode,
        )
        sync = dp.begin_ubatch_run() if dp_metadata is not None else None
        run = UBatchRun(
            len(ubatch_slices),
            self.timeout_s,
            peer_failure=sync.peer_failure if sync is not None else None,
            on_failure=(
                (lambda exc, i: sync.announce_failure(self._describe(exc, i)))
                if sync is not None else None
            ),
            sync=sync,
        )
        self.ready_barrier = threading.Barrier(len(ubatch_slices) + 1)
        contexts = make_ubatch_contexts(
            num_micro_batches=len(ubatch_slices),
            compute_stream=compute_stream,
            comm_stream=self.comm_stream,
            forward_contexts=forward_contexts,
            ready_barrier=self.ready_barrier,
            run=run,
        )
        out = []
        for i, s in enumerate(ubatch_slices):
            ids, pos, embeds, inter = self._slice_model_inputs(
                s.token_slice, input_ids, positions, inputs_embeds, intermediate_tensors
            )
            out.append(UbatchMetadata(contexts[i], ids, pos, embeds, inter, s.num_tokens))
        return out

    # The micro-batch's share of the inputs (kept as a method: subclasses and tests
    # reach it on the wrapper).
    _slice_model_inputs = staticmethod(slice_model_inputs)
