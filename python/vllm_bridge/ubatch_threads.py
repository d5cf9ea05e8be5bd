"""The threads of a micro-batched run: the part of
:class:`~vllm_bridge.ubatch_wrapper.UBatchWrapper` that starts one thread per micro-batch,
meets them at the barrier, waits for them, and ends the run with the other DP ranks.

Apart from the wrapper so that what can go wrong with threads reads in one place: every
wait here is bounded, a thread is declared stuck only when no thread has made progress
for ``2 * timeout_s`` (:meth:`UBatchThreads._join`), the main thread's own failure (an
interrupt while it waits) fails the run and joins the threads before it is re-raised
(:meth:`UBatchThreads._abandon`), and every rank ends the run with the same outcome
(:meth:`UBatchThreads._finish`; why each part: :mod:`vllm_bridge.dp._ubatch_sync`). The
wrapper (and the graph capture, :mod:`vllm_bridge.ubatch_graphs`) build the run and call
these; the threads take turns inside it through :mod:`vllm_bridge.ubatching`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from vllm_bridge import dp
from vllm_bridge.forward_context import override_forward_context
from vllm_bridge.ubatching import (
    MAIN_THREAD,
    UBatchAbortedError,
    UBatchContext,
    UBatchRun,
    barrier_timeout_message,
    describe_thread,
)

if TYPE_CHECKING:
    from vllm_bridge.ubatch_metadata import UbatchMetadata

__all__ = ["JOIN_MARGIN_S", "JOIN_POLL_S", "UBatchThreads"]

# After the run has failed, joining a thread waits at most this much for it to notice.
JOIN_MARGIN_S = 5.0
# The main thread waits for its threads in slices of this much, so an interrupt (a signal)
# is acted on within it.
JOIN_POLL_S = 0.05


class UBatchThreads:
    """Running a micro-batched run on its threads; mixed into ``UBatchWrapper``, which
    sets the attributes below (see there)."""

    device: torch.device
    use_cuda: bool

    def _describe(self, exc: BaseException, ubatch_id: int) -> str:
        info = dp.dp_group_info()
        rank = f"DP rank {info.rank} " if info is not None else ""
        return f"{rank}{describe_thread(ubatch_id)} failed: {type(exc).__name__}: {exc}"

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
