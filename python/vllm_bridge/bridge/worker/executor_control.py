"""What the other threads do to the execution thread: the part of
:class:`~vllm_bridge.bridge.worker.executor.Executor` that the watcher, the server and
the dispatcher call while a request runs (see the executor's module for who reads fd 3
when).

* the watcher queues what it reads behind the running request (:meth:`ExecutorControl.submit`);
* the server cancels a request (queued: dropped; running: marked and interrupted), gives
  a stream credit, stops everything at the end (:meth:`~ExecutorControl.cancel`,
  :meth:`~ExecutorControl.grant`, :meth:`~ExecutorControl.stop`), and reads the status
  a ``pong`` carries (:attr:`~ExecutorControl.running_id`, ...);
* the dispatcher attaches a stream's flow control (:meth:`~ExecutorControl.open_flow`),
  and the interrupter asks for a second signal (:meth:`~ExecutorControl.interrupt_again`).

Apart from the executor so that its module holds only the execution thread's own loop
(the per-request path) and reads on its own, as the watcher's loop does in
:mod:`~vllm_bridge.bridge.worker.watcher`. Nothing the execution thread runs per request
is here, and the move added no call and no attribute lookup anywhere: each method is the
same code as before, and a method is found through its class's method cache (in 3.11 a
specialised lookup keyed by the type's version), wherever in the bases it is defined;
``submit``, which the watcher calls for each request it reads, included.
:class:`ExecutorControl` derives from :class:`~vllm_bridge.bridge.worker.watcher.Watcher`
for the state it declares (the lock, the running request, the role) and the wake-ups both
use (``_wake``, ``_tell_eof``); ``Executor.__init__`` sets that state.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from vllm_bridge.bridge.protocol.flow import STREAM_WINDOW, Flow
from vllm_bridge.bridge.protocol.messages import Abandon, Request
from vllm_bridge.bridge.worker.watcher import ROLE_NOBODY, Watcher

__all__ = ["ExecutorControl"]


class ExecutorControl(Watcher):
    """The executor's entry points for the other threads (see the module docstring)."""

    # Set by Executor.__init__ (see there), beside those Watcher declares.
    _queue: deque[Request]
    _began: float
    _interrupt: Callable[[], None]

    @property
    def running_id(self) -> int | None:
        """Id of the request running now, if any."""
        running = self._running
        return None if running is None else running.id

    @property
    def running_for(self) -> float | None:
        """Seconds the running request has run, or ``None`` when none runs."""
        running, began = self._running, self._began
        return None if running is None else max(0.0, time.monotonic() - began)

    @property
    def queued(self) -> int:
        """Number of requests waiting."""
        return len(self._queue)

    def submit(self, request: Request) -> None:
        """Queue ``request`` behind those already queued (a stream that waits for credit
        then stops waiting: see :class:`vllm_bridge.bridge.protocol.flow.Flow`)."""
        with self._lock:
            self._queue.append(request)
            self._cond.notify_all()
            running = self._running
        if running is not None and running.flow is not None:
            running.flow.nudge()

    def open_flow(self, request: Request, window: int = STREAM_WINDOW) -> Flow:
        """The flow control of the stream ``request`` runs, attached to it under the lock,
        so that a cancel or a stop reaches it whenever it comes (one that came before is
        applied at once). It does not wait while requests are queued, and before it waits
        it makes the watcher read the input at once (:meth:`_want_reader`)."""
        flow = Flow(
            window, others_waiting=lambda: bool(self._queue), before_wait=self._want_reader
        )
        with self._lock:
            request.flow = flow
            if self._stopping or request.cancelled:
                flow.stop()
        return flow

    def grant(self, request_id: int, n: int) -> None:
        """Room for ``n`` more chunks to the stream ``request_id``, if it is the one
        running (a credit for any other request is ignored)."""
        with self._lock:
            running = self._running
            if running is not None and running.id == request_id and running.flow is not None:
                running.flow.grant(n)

    def _want_reader(self) -> None:
        # The running request is about to wait for a frame: the watcher takes the reading
        # role at its next look, which comes at once, not after two polls.
        with self._lock:
            if self._role != ROLE_NOBODY:
                return  # the watcher reads already
            self._urgent = True
        self._watcher_wake.set()

    def cancel(self, request_id: int) -> Request | None:
        """Cancel the request with this id.

        Returns:
            The request if it was still queued (it is removed and will not run; the
            caller answers it), else ``None`` (a running request is marked cancelled and
            interrupted; it answers for itself).
        """
        with self._lock:
            for request in self._queue:
                # An Abandon carries the id of the enter it cleans up after: never dropped.
                if request.id == request_id and not isinstance(request, Abandon):
                    self._queue.remove(request)
                    return request
            running = self._running
            if running is not None and running.id == request_id:
                running.cancelled = True
                _stop_flow(running)
                # Marked first: the handler raises only for a request marked cancelled.
                # Signalled under the lock, so while the request is still the running
                # one: the signal reaches the thread before the next request can start,
                # never inside that one's blocking call (see interrupt.py, "EINTR").
                self._interrupt()
        return None

    def interrupt_again(self, request: Request, delay: float) -> None:
        """Signal the execution thread again in ``delay`` seconds if ``request`` is still
        the running one then, and cancelled (the handler defers an interruption that
        lands inside :mod:`logging`: see :mod:`vllm_bridge.bridge.worker.interrupt`)."""

        def again() -> None:
            with self._lock:
                if self._running is request and request.cancelled:
                    self._interrupt()

        timer = threading.Timer(delay, again)
        timer.daemon = True
        timer.start()

    def stop(self) -> None:
        """Drop the queue and interrupt the running request (if any); then the execution
        thread runs ``final``."""
        self._halt()

    def _halt(self, eof: bool = False) -> bool:
        # Drop the queue, cancel the running request (its stream's wait stops, its code is
        # interrupted), wake both threads; True the first time (stop() or the end of the
        # input, whichever comes first). At the end of the input, on_eof closes the output
        # first: the interrupted request answers at once, and a write to a peer that is gone
        # would end the process before the sessions' contexts are exited.
        with self._lock:
            first = not self._stopping
            self._queue.clear()
            self._stopping = True
            self._cond.notify_all()
            running = self._running
            if running is not None:
                running.cancelled = True
                _stop_flow(running)
        if eof and first:
            self._tell_eof()
        if running is not None:
            with self._lock:  # as cancel does: only while it is still the running one
                if self._running is running:
                    self._interrupt()
        self._wake()
        self._watcher_wake.set()
        return first


def _stop_flow(request: Request) -> None:
    """A stream waiting for credit stops waiting (it was cancelled, or the input ended)."""
    if request.flow is not None:
        request.flow.stop()
