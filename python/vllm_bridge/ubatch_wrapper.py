"""UBatchWrapper: a micro-batched forward pass, each micro-batch on its own thread, the two
taking turns at the communication points (as vLLM's ``gpu_ubatch_wrapper``).

``UBatchWrapper(runnable, vllm_config, runtime_mode, device)`` is called like the model
inside a forward context. Without ``ubatch_slices`` in the context it just calls the
runnable. With them it:

1. builds one forward context per micro-batch (its attention metadata and slot mapping,
   DP counts of the micro-batch's size) and slices the inputs (:meth:`_make_ubatch_metadata`);
2. gives each micro-batch a :class:`~vllm_bridge.ubatching.UBatchContext`: compute and comm
   streams and a CPU wait event on CUDA, the same without streams on the CPU;
3. starts one thread per micro-batch; the threads and the main one meet at
   ``ready_barrier``, then the main thread hands the first turn to micro-batch 0 and joins
   them (:meth:`_run_ubatches`). The threads hand over at the MoE layer's collectives
   (see :mod:`vllm_bridge.ubatching`), so one's all-gather / all-reduce overlaps the
   other's compute;
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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from vllm_bridge import dp
from vllm_bridge.config import VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import (
    DPMetadata,
    ForwardContext,
    create_forward_context,
    get_forward_context,
    override_forward_context,
)
from vllm_bridge.sm_control import SMControlContextManager, create_sm_control
from vllm_bridge.ubatch_graphs import CUDAGraphMetaData, UBatchGraphs, ubatch_graph_action
from vllm_bridge.ubatching import (
    MAIN_THREAD,
    UBatchAbortedError,
    UBatchContext,
    UBatchRun,
    barrier_timeout_message,
    describe_thread,
    make_ubatch_contexts,
)

__all__ = [
    "CUDAGraphMetaData",
    "SMControlContextManager",
    "UBatchWrapper",
    "UbatchMetadata",
    "make_ubatch_forward_contexts",
    "ubatch_graph_action",
]

# After the run has failed, joining a thread waits at most this much for it to notice.
JOIN_MARGIN_S = 5.0
# The main thread waits for its threads in slices of this much, so an interrupt (a signal)
# is acted on within it.
JOIN_POLL_S = 0.05


@dataclass
class UbatchMetadata:
    """One micro-batch: its context and its slice of the inputs."""

    context: UBatchContext
    input_ids: torch.Tensor
    positions: torch.Tensor
    inputs_embeds: torch.Tensor | None
    intermediate_tensors: Any | None
    num_tokens: int


def _ubatch_dp_metadata(
    vllm_config: VllmConfig, meta: DPMetadata | None, num_tokens: int
) -> DPMetadata | None:
    """The micro-batch's DP counts: every rank splits at the same point, so each rank's
    micro-batch ``i`` has ``num_tokens`` tokens (checked against the config)."""
    if meta is None:
        return None
    counts = torch.full_like(meta.num_tokens_across_dp_cpu, num_tokens)
    return DPMetadata.make(vllm_config.parallel_config, num_tokens, counts)


def make_ubatch_forward_contexts(
    vllm_config: VllmConfig,
    ubatch_slices: list,
    attn_metadata: Any,
    slot_mapping: Any,
    dp_metadata: DPMetadata | None,
    batch_descriptor: Any,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
) -> list[ForwardContext]:
    """One forward context per micro-batch (the overlapped run's threads and the sequential
    reference both use these): its entry of ``attn_metadata`` and ``slot_mapping`` (lists
    with one entry per micro-batch, or ``None``) and DP counts of its own size.

    Raises:
        ValueError: ``attn_metadata`` or ``slot_mapping`` is not one entry per micro-batch.
    """
    for name, value in (("attn_metadata", attn_metadata), ("slot_mapping", slot_mapping)):
        if value and not (isinstance(value, list) and len(value) == len(ubatch_slices)):
            raise ValueError(
                f"{name} of a micro-batched pass must be a list of {len(ubatch_slices)} "
                f"entries (one per micro-batch), got {type(value).__name__}"
            )
    return [
        create_forward_context(
            attn_metadata[i] if attn_metadata else None,
            vllm_config,
            dp_metadata=_ubatch_dp_metadata(vllm_config, dp_metadata, s.num_tokens),
            batch_descriptor=batch_descriptor,
            cudagraph_runtime_mode=cudagraph_runtime_mode,
            slot_mapping=slot_mapping[i] if slot_mapping else None,
        )
        for i, s in enumerate(ubatch_slices)
    ]


class UBatchWrapper(UBatchGraphs):
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

    def _slice_model_inputs(
        self,
        tokens_slice: slice,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None,
        intermediate_tensors: Any | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Any | None]:
        # M-RoPE positions carry an extra leading dimension: slice the token axis.
        if positions.ndim == 2:
            sliced_positions = positions[:, tokens_slice]
        else:
            sliced_positions = positions[tokens_slice]
        return (
            input_ids[tokens_slice],
            sliced_positions,
            inputs_embeds[tokens_slice] if inputs_embeds is not None else None,
            intermediate_tensors[tokens_slice] if intermediate_tensors is not None else None,
        )

    def _describe(self, exc: BaseException, ubatch_id: int) -> str:
        info = dp.dp_group_info()
        rank = f"DP rank {info.rank} " if info is not None else ""
        return f"{rank}{describe_thread(ubatch_id)} failed: {type(exc).__name__}: {exc}"

    # -- running -----------------------------------------------------------------------------

    @staticmethod
    def _call_model(model: Callable[..., Any], meta: UbatchMetadata) -> Any:
        kwargs: dict[str, Any] = {"input_ids": meta.input_ids, "positions": meta.positions}
        if meta.inputs_embeds is not None:
            kwargs["inputs_embeds"] = meta.inputs_embeds
        if meta.intermediate_tensors is not None:
            kwargs["intermediate_tensors"] = meta.intermediate_tensors
        return model(**kwargs)

    def _thread_setup(self, ctx: UBatchContext, capture: bool) -> None:
        """A thread's own set-up, before it meets the others at the barrier."""
        if self.use_cuda:
            torch.cuda.set_device(self.device)
        if capture:
            # Each thread creates its CUDA state (cuBLAS handle) for both streams before
            # the capture starts: creating it during capture is not allowed.
            for stream in (ctx.compute_stream, ctx.comm_stream):
                with torch.cuda.stream(stream):
                    torch.cuda.current_blas_handle()

    def _thread_main(
        self, results: list, model: Callable[..., Any], meta: UbatchMetadata, capture: bool
    ) -> None:
        ctx = meta.context
        try:
            with torch.inference_mode():
                self._thread_setup(ctx, capture)
                with ctx:
                    results[ctx.id] = self._call_model(model, meta)
        except BaseException as exc:  # recorded for the main thread, never lost
            ctx.run.fail(exc, ctx.id)
        finally:
            ctx.run.progress()
            ctx.exited.set()

    def _start_threads(
        self, metadata: list[UbatchMetadata], model: Callable[..., Any], capture: bool
    ) -> list:
        """Start one thread per micro-batch (kept in ``run.threads``, so a failure of the
        main thread meanwhile can still join the ones started) and meet them at the
        barrier. Returns the list the threads put their outputs in."""
        run = metadata[0].context.run
        results: list[Any] = [None] * len(metadata)
        run.threads = [
            threading.Thread(
                target=self._thread_main,
                args=(results, model, meta, capture),
                name=f"vllm-bridge-ubatch-{meta.context.id}",
                daemon=True,
            )
            for meta in metadata
        ]
        for thread in run.threads:
            thread.start()
        try:
            metadata[0].context.ready_barrier.wait(timeout=run.timeout_s)
        except threading.BrokenBarrierError:
            if run.error is None:
                # Not a thread's failure (that would be recorded): the main thread's own
                # wait timed out. Fail the run, so the peers hear of it now.
                run.fail(TimeoutError(barrier_timeout_message(run.timeout_s)), MAIN_THREAD)
        return results

    def _join(self, run: UBatchRun) -> None:
        """Wait until the run's threads have ended. A thread is stuck only when no thread
        has made progress for ``2 * timeout_s`` (each wait in a thread is bounded by that):
        then the run fails, which wakes them, and each gets ``JOIN_MARGIN_S`` more.

        Waits on each context's ``exited`` event rather than ``Thread.join``: an interrupt
        (``KeyboardInterrupt``, the worker's cancel) raised in ``Thread.join`` can leave a
        running thread marked as stopped (CPython 3.11), and this wait must be safe to
        interrupt and repeat.
        """
        started = [
            ctx for ctx, thread in zip(run.contexts, run.threads) if thread.ident is not None
        ]
        limit = 2 * run.timeout_s
        while True:
            pending = [ctx for ctx in started if not ctx.exited.is_set()]
            if not pending:
                break
            idle = time.monotonic() - run.progress_at
            if idle >= limit:
                run.fail(
                    TimeoutError(f"no micro-batch thread made progress for {limit} s"),
                    MAIN_THREAD,
                )
                for ctx in pending:
                    ctx.exited.wait(JOIN_MARGIN_S)
                break
            # In short slices: a signal that arrives just before the wait begins (its
            # C handler has run, the Python one not yet) does not wake the wait, and
            # would otherwise wait out the whole slice before the interrupt is raised.
            pending[0].exited.wait(min(limit - idle, JOIN_POLL_S))
        for ctx in started:
            if ctx.exited.is_set():
                run.threads[ctx.id].join(JOIN_MARGIN_S)  # only its last few bytecodes

    def _abandon(self, metadata: list[UbatchMetadata], exc: BaseException) -> NoReturn:
        """The main thread failed (``exc``: e.g. an interrupt while it waited): fail the
        run (the peers are told, the threads stop before their next collective), join the
        threads, end the run with the peers (the group is drained as after any failure),
        and raise ``exc``; an error from ending the run is chained to it."""
        run = metadata[0].context.run
        run.fail(exc, MAIN_THREAD)  # a no-op when a thread failed first: its error stays
        try:
            self._join(run)
            if not run.ended:
                self._finish(metadata, [])
        except BaseException:
            raise exc  # noqa: B904 - the other error is exc's __context__
        raise exc

    def _finish(self, metadata: list[UbatchMetadata], results: list) -> Any:
        """End the run on every rank together: raise the run's failure (this rank's own
        error, or another rank's as UBatchAbortedError), else the outputs in order."""
        run = metadata[0].context.run
        run.ended = True  # once only: the peers exchange one outcome per run
        error = run.error
        sync = run.sync
        message = None
        if error is not None:
            if isinstance(error, UBatchAbortedError):
                message = str(error)
            else:
                message = self._describe(error, run.error_ubatch)
        try:
            failure = sync.finish(message, run.posted, run.works) if sync is not None else message
        except RuntimeError as exc:
            # The ranks could not end the run together: the group is marked broken.
            raise UBatchAbortedError(
                f"ending the micro-batched run on every DP rank failed ({exc}); "
                f"the run itself {'failed: ' + message if message else 'had succeeded here'}"
            ) from exc
        if error is not None and not isinstance(error, UBatchAbortedError):
            raise error
        if failure is not None:
            raise UBatchAbortedError(failure) from error
        return torch.cat(results, dim=0)

    def _run_ubatches(
        self, ubatch_metadata: list[UbatchMetadata], model: Callable[..., Any]
    ) -> Any:
        """Run the micro-batches on their threads, taking turns; the outputs concatenated
        in micro-batch order."""
        # The threads set their own forward contexts; the main one holds none meanwhile
        # and gets its own back afterwards.
        with override_forward_context(None):
            try:
                results = self._start_threads(ubatch_metadata, model, capture=False)
                ubatch_metadata[0].context.cpu_wait_event.set()
                self._join(ubatch_metadata[0].context.run)
            except BaseException as exc:
                self._abandon(ubatch_metadata, exc)
        return self._finish(ubatch_metadata, results)
