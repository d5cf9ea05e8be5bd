"""Per-micro-batch contexts: two threads that take turns, handing over at communication.

A micro-batched forward pass (:class:`~vllm_bridge.ubatch_wrapper.UBatchWrapper`) runs each
micro-batch on its own thread, as vLLM's dual-batch overlap does. Exactly one of the two
threads runs at a time. A thread that starts a collective launches it asynchronously,
hands the turn to the other thread (which computes meanwhile), and waits on the
collective only when the turn comes back::

    A: compute ... launch gather(A1) -> yield         ... resume, wait A1, compute ...
    B:                                   compute ... launch gather(B1) -> yield ...

Because only one thread runs at a time and the hand-over points are the collectives
themselves, the order in which a rank issues its collectives is fixed by the model (A1,
B1, A2, B2, ...): the same on every rank, which gloo and NCCL both require.

On CUDA each context has a compute stream and a comm stream; a collective is launched on
the comm stream after it waits for the compute stream, and the compute stream waits for
the comm stream before the result is used (``wait_stream`` records and waits on events). On the CPU
there are no streams: the same threads and hand-overs run over gloo.

The turn is passed with ``threading.Event`` s (``cpu_wait_event``: set when it is this
thread's turn). Every wait here is bounded and polls the run's error flag, so one thread's
failure wakes the other at once (see :class:`UBatchRun`).

Outside a micro-batched run :func:`current_ubatch_context` is ``None`` and nothing here
runs: the DP collectives take their plain path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from vllm_bridge._ubatch_current import UBatchAbortedError, current_ubatch_context
from vllm_bridge._ubatch_current import ubatch_context_var as _current
from vllm_bridge.forward_context import ForwardContext, _forward_context_var

__all__ = [
    "MAIN_THREAD",
    "HandOverPoint",
    "UBatchAbortedError",
    "UBatchContext",
    "UBatchRun",
    "current_ubatch_context",
    "make_ubatch_contexts",
    "set_fault_injector",
]

# How often a blocked wait looks at the run's error flag (and, waiting on communication,
# at the peers' failure notices). Only waits that are still blocked pay it.
POLL_S = 0.01
PEER_POLL_S = 0.05

#: The ``ubatch_id`` a failure of the main (calling) thread is recorded under: it waits
#: at the barrier and joins the micro-batch threads, and can itself be interrupted there
#: (``KeyboardInterrupt``, the worker's cancel).
MAIN_THREAD = -1


def barrier_timeout_message(timeout_s: float) -> str:
    """The error of a run whose threads did not all reach the ready barrier in time."""
    return f"the micro-batch threads did not all reach the ready barrier within {timeout_s} s"


def describe_thread(ubatch_id: int | None) -> str:
    """``"micro-batch 1"``, or ``"main thread (waiting for its micro-batches)"``."""
    if ubatch_id == MAIN_THREAD:
        return "main thread (waiting for its micro-batches)"
    return f"micro-batch {ubatch_id}"


@dataclass(frozen=True)
class HandOverPoint:
    """Where a micro-batch thread hands over (what a fault injector is told).

    Attributes:
        ubatch_id: The micro-batch (0 or 1).
        index: The collective's number within the micro-batch's pass (0, 1, ...).
        where: ``"launch"``: before the collective is issued; ``"resume"``: the turn came
            back, before waiting on the collective.
        what: The collective (``"all_gather"``, ``"all_reduce"``).
    """

    ubatch_id: int
    index: int
    where: Literal["launch", "resume"]
    what: str  # the DP collectives' names; tests' stand-in collectives pass their own


_injector: Callable[[HandOverPoint], None] | None = None


def set_fault_injector(injector: Callable[[HandOverPoint], None] | None) -> None:
    """For tests: call ``injector(point)`` at every hand-over point of every micro-batched
    run in this process (it may raise to simulate a failure there); ``None`` turns it off
    (the default: one ``is None`` check per hand-over)."""
    global _injector
    if injector is not None and not callable(injector):
        raise TypeError(f"injector must be callable or None, got {injector!r}")
    _injector = injector


class UBatchRun:
    """What the contexts of one micro-batched run share: who has finished, the first
    failure, and how to learn of a peer rank's failure.

    Args:
        num_micro_batches: Threads in the run.
        timeout_s: The most one wait may take (a collective, the turn, the barrier).
        peer_failure: Returns another rank's failure message, or ``None`` (polled while a
            collective is pending); ``None``: single process.
        on_failure: Called once with the first local failure (e.g. to tell the peers).
        sync: The run's link to the other DP ranks
            (:class:`~vllm_bridge.dp._ubatch_sync.UBatchRunSync`), or ``None``.
    """

    def __init__(
        self,
        num_micro_batches: int,
        timeout_s: float,
        peer_failure: Callable[[], str | None] | None = None,
        on_failure: Callable[[BaseException, int], None] | None = None,
        sync: Any = None,
    ) -> None:
        self.lock = threading.Lock()
        self.finished = [False] * num_micro_batches
        self.error: BaseException | None = None
        self.error_ubatch: int | None = None
        self.timeout_s = timeout_s
        self.peer_failure = peer_failure
        self.on_failure = on_failure
        self.contexts: list[UBatchContext] = []
        # Every collective the run posted, in order, and its work: what the DP group needs
        # to be drained after a failure (vllm_bridge.dp._ubatch_sync).
        self.posted: list[Any] = []
        self.works: list[Any] = []
        self.sync = sync
        self.threads: list[threading.Thread] = []  # set by the wrapper as it starts them
        self.ended = False  # the wrapper has begun ending the run with the peers
        # When a thread last made progress (started, handed over, finished): the main
        # thread declares the run stuck only after 2 * timeout_s without any.
        self.progress_at = time.monotonic()

    def progress(self) -> None:
        """Record that a thread moved on (see ``progress_at``)."""
        self.progress_at = time.monotonic()

    def fail(self, exc: BaseException, ubatch_id: int) -> None:
        """Record ``exc`` (the first failure wins), then wake every waiting thread."""
        with self.lock:
            first = self.error is None
            if first:
                self.error, self.error_ubatch = exc, ubatch_id
        if first and self.on_failure is not None and not isinstance(exc, UBatchAbortedError):
            try:
                self.on_failure(exc, ubatch_id)
            except Exception:  # telling the peers is best effort: they time out otherwise
                pass
        for ctx in self.contexts:
            ctx.cpu_wait_event.set()
        if self.contexts:
            self.contexts[0].ready_barrier.abort()

    def check(self) -> None:
        """Raise if the run failed elsewhere (this thread must stop)."""
        if self.error is not None:
            raise UBatchAbortedError(
                f"{describe_thread(self.error_ubatch)} failed: "
                f"{type(self.error).__name__}: {self.error}"
            )


class UBatchContext:
    """One micro-batch thread's context: its forward context, streams, turn event and the
    barrier all threads of the run (and the main one) meet at before starting.

    Used as ``with ctx:`` around the micro-batch's forward pass, on its own thread:
    entering sets the thread's forward context and micro-batch context, meets the
    barrier and waits for the turn; leaving passes the turn on for good (or, on an
    exception, fails the run).
    """

    def __init__(
        self,
        id: int,
        run: UBatchRun,
        forward_context: ForwardContext | None,
        ready_barrier: threading.Barrier,
        compute_stream: Any = None,
        comm_stream: Any = None,
    ) -> None:
        self.id = id
        self.run = run
        self.forward_context = forward_context
        self.ready_barrier = ready_barrier
        self.compute_stream = compute_stream
        self.comm_stream = comm_stream
        self.cpu_wait_event = threading.Event()
        # Set by the thread as it ends: what the main thread waits on, not Thread.join
        # (in CPython 3.11 a join interrupted by a signal's exception can mark a thread
        # that is still running as stopped).
        self.exited = threading.Event()
        self.num_collectives = 0
        self._tokens: list[Any] = []

    # -- entering and leaving -------------------------------------------------------------

    def __enter__(self) -> UBatchContext:
        # A new thread starts with an empty contextvars context: set ours here.
        self._tokens = [_current.set(self), _forward_context_var.set(self.forward_context)]
        try:
            self.ready_barrier.wait(timeout=self.run.timeout_s)
        except threading.BrokenBarrierError:
            self.run.check()  # broken by a failure elsewhere: that failure
            # Broken with no failure recorded: a wait at it timed out (here or elsewhere).
            raise TimeoutError(barrier_timeout_message(self.run.timeout_s)) from None
        self.run.progress()
        self._wait_turn()
        if self.compute_stream is not None:
            torch.cuda.set_stream(self.compute_stream)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        for token in reversed(self._tokens):
            token.var.reset(token)
        self._tokens = []
        if exc is not None:
            self.run.fail(exc, self.id)
            return
        with self.run.lock:
            self.run.finished[self.id] = True
        self._pass_turn()

    # -- the hand-over ---------------------------------------------------------------------

    def _others_alive(self) -> list[UBatchContext]:
        with self.run.lock:
            return [c for c in self.run.contexts if c is not self and not self.run.finished[c.id]]

    def _pass_turn(self) -> bool:
        """Give the turn to the next unfinished thread; False when there is none."""
        self.run.progress()
        alive = self._others_alive()
        if not alive:
            return False
        nxt = min(alive, key=lambda c: (c.id - self.id) % len(self.run.contexts))
        nxt.cpu_wait_event.set()
        return True

    def _wait_turn(self) -> None:
        deadline = time.monotonic() + 2 * self.run.timeout_s
        while not self.cpu_wait_event.wait(POLL_S):
            self.run.check()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"micro-batch {self.id} did not get its turn back within "
                    f"{2 * self.run.timeout_s} s"
                )
        self.cpu_wait_event.clear()
        self.run.check()

    def yield_(self) -> None:
        """Let the other micro-batch run until it hands the turn back (a no-op when it has
        finished)."""
        if self._pass_turn():
            self._wait_turn()

    def _inject(self, where: str, what: str) -> None:
        injector = _injector
        if injector is not None:
            injector(HandOverPoint(self.id, self.num_collectives, where, what))

    # -- a collective as a hand-over point -------------------------------------------------

    def launch(self, what: str, start: Callable[[], Any], description: Any = None) -> Any:
        """Issue a collective (``start()`` returns its async work): on CUDA on the comm
        stream, after it has waited for the compute stream. ``description`` (what it was)
        is kept with the work in the run's log."""
        self.run.check()
        self._inject("launch", what)
        if self.comm_stream is None:
            work = start()
        else:
            self.comm_stream.wait_stream(self.compute_stream)
            with torch.cuda.stream(self.comm_stream):
                work = start()
        with self.run.lock:
            self.run.posted.append(description)
            self.run.works.append(work)
        return work

    def handover(self, what: str) -> None:
        """Hand the turn over while this thread's collective is in flight; returns when the
        turn is back (or at once when the other micro-batch has finished)."""
        self.yield_()
        self._inject("resume", what)

    def wait(self, what: str, work: Any, timeout_s: float) -> None:
        """Wait on this thread's collective (bounded), after :meth:`handover`.

        Raises:
            UBatchAbortedError: another thread, or another rank, failed meanwhile.
            TimeoutError: the collective did not complete within ``timeout_s``.
            RuntimeError: the collective itself failed.
        """
        index = self.num_collectives
        self.num_collectives += 1
        if self.comm_stream is not None and torch.cuda.is_current_stream_capturing():
            # Under graph capture nothing runs: the wait is a stream dependency only.
            with torch.cuda.stream(self.comm_stream):
                work.wait()
            self.compute_stream.wait_stream(self.comm_stream)
            return
        self._wait_work(what, index, work, timeout_s)
        # Completed: wait() now only raises the collective's own error, if it failed, and
        # (NCCL) makes the comm stream wait for it; then compute joins the comm stream.
        if self.comm_stream is None:
            work.wait()
            return
        with torch.cuda.stream(self.comm_stream):
            work.wait()
        self.compute_stream.wait_stream(self.comm_stream)

    def _wait_work(self, what: str, index: int, work: Any, timeout_s: float) -> None:
        """Until ``work`` completes (bounded), watching the run and the peers."""
        if work.is_completed():
            return  # the common case after a hand-over: no future, no poll
        done = threading.Event()
        try:
            work.get_future().add_done_callback(lambda _: done.set())
        except (AttributeError, RuntimeError):
            pass  # no future: poll is_completed() below
        deadline = time.monotonic() + timeout_s
        next_peer_check = time.monotonic() + PEER_POLL_S
        while not (work.is_completed() or done.wait(POLL_S)):
            self.run.check()
            now = time.monotonic()
            if self.run.peer_failure is not None and now >= next_peer_check:
                next_peer_check = now + PEER_POLL_S
                message = self.run.peer_failure()
                if message is not None:
                    raise UBatchAbortedError(message)
            if now > deadline:
                raise TimeoutError(
                    f"micro-batch {self.id}: {what} #{index} did not complete within "
                    f"{timeout_s} s; a peer is missing or stuck"
                )


def make_ubatch_contexts(
    num_micro_batches: int,
    compute_stream: Any,
    comm_stream: Any,
    forward_contexts: list[ForwardContext | None],
    ready_barrier: threading.Barrier,
    run: UBatchRun,
) -> list[UBatchContext]:
    """One context per micro-batch, sharing ``run`` and ``ready_barrier``.

    On CUDA every context computes on ``compute_stream`` (the caller's current stream,
    the capture stream under graph capture: one thread runs at a time, so the kernels of
    the two micro-batches queue on it in the order the threads issue them) and
    communicates on ``comm_stream``, which forks from and joins back into it at each
    collective. ``None`` streams (CPU): no streams at all.
    """
    if num_micro_batches < 2:
        raise ValueError(f"num_micro_batches must be >= 2, got {num_micro_batches}")
    if len(forward_contexts) != num_micro_batches:
        raise ValueError(
            f"{len(forward_contexts)} forward contexts for {num_micro_batches} micro-batches"
        )
    contexts = [
        UBatchContext(i, run, forward_contexts[i], ready_barrier, compute_stream, comm_stream)
        for i in range(num_micro_batches)
    ]
    run.contexts = contexts
    return contexts
