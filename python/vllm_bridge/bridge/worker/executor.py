"""The execution thread, and who reads fd 3 when.

Requests run one at a time, in arrival order, on one execution thread (:meth:`Executor.run`;
in the worker it is the main thread, so that a cancel can interrupt the running request:
see :mod:`vllm_bridge.bridge.worker.interrupt`). Reading frames is a *role* that two threads
pass between them under one lock:

* while the execution thread is idle it reads fd 3 itself: a request it reads runs at
  once, on the thread that read it, with no hand-over between threads (the common case:
  one short call after another);
* the *watcher* (:meth:`Executor.watch`, a thread of its own, in
  :mod:`~vllm_bridge.bridge.worker.watcher`) looks every ``poll`` seconds (every
  :data:`~vllm_bridge.bridge.worker.watcher.IDLE_POLL_SECONDS` once the worker has been
  idle for a few looks); when it sees the same request running at two looks in a row, it
  takes the role and reads: it answers ``ping`` at once, records ``cancel``\\ s and
  queues requests, so a long call never blocks liveness;
* a stream about to wait for credit (:meth:`Executor.open_flow`) wakes the watcher,
  which takes the role at once: the credit is in the input, and nobody else reads it;
* when the execution thread finds its queue empty while the watcher reads, it asks for
  the role back (a byte on a wake-up pipe interrupts the watcher's ``select``) and reads
  again itself.

A request whose deadline passed before its turn is answered with a ``timeout`` error and
not started. A queued request can be cancelled (it is dropped; the caller answers it); a
running one is marked and interrupted (the ``interrupt`` hook: its code stops where it
is; a stream also stops at its next chunk; an ``enter`` exits the context again once
``__enter__`` returns). The end of the input (or :meth:`Executor.stop`) does the same to
the running request.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from vllm_bridge.bridge.protocol.errors import DeadlineExceeded, python_type_name, safe_str
from vllm_bridge.bridge.protocol.flow import STREAM_WINDOW, Flow
from vllm_bridge.bridge.protocol.framing import FrameReader
from vllm_bridge.bridge.protocol.messages import Abandon, Request
from vllm_bridge.bridge.worker.watcher import (
    POLL_SECONDS,
    ROLE_EXEC,
    ROLE_NOBODY,
    ROLE_WATCH,
    Watcher,
)

_log = logging.getLogger("vllm_bridge.bridge.worker")

class Executor(Watcher):
    """One execution thread; the reading role shared with the watcher (:class:`Watcher`)."""

    def __init__(
        self,
        handle: Callable[[Request], Any],
        expired: Callable[[Request, DeadlineExceeded], Any],
        write: Callable[[Any], None],
        on_frame: Callable[[bytearray | memoryview], Request | None],
        reader: FrameReader,
        on_eof: Callable[[], None] = lambda: None,
        poll: float = POLL_SECONDS,
        interrupt: Callable[[], None] = lambda: None,
        failed: Callable[[Request, str], Any] | None = None,
        own_frame: Callable[[bytearray | memoryview], Request | None] | None = None,
        hold: Callable[[Any], bool] | None = None,
        flush: Callable[[], None] = lambda: None,
    ) -> None:
        """
        Args:
            handle: Runs one request and returns its final reply, encoded (``None``: no
                reply); must not raise.
            expired: The reply of a request whose deadline passed before it started.
            write: Sends a reply. The final reply is sent after the request stops
                counting as running, so a ``pong`` never names a request already answered.
            on_frame: Handles one frame body on the thread that read it: answers what
                needs no execution (``ping``, ``cancel``, refusals) and returns the
                request to run, or ``None``.
            reader: The buffered reader of fd 3.
            on_eof: Called once, by the thread that reads EOF (or a broken stream).
            poll: Seconds between two looks of the watcher (:data:`POLL_SECONDS`).
            interrupt: Called under the lock, while the request marked cancelled is still
                the running one, to interrupt its code (the worker signals the execution
                thread: :meth:`vllm_bridge.bridge.worker.interrupt.Interrupter.interrupt`); it
                must not take the lock.
            failed: The reply of a request whose ``handle`` (or ``expired``) raised after
                all, given a message that says so: every request is answered. ``None``:
                such a request is only logged.
            own_frame: ``on_frame`` for the frames the execution thread reads itself
                (the worker's lane: :mod:`vllm_bridge.bridge.worker.lane`); default
                ``on_frame``.
            hold: Keeps a reply for the next write (True) when the next request is read
                already (``Channel.hold``; ``None``: none kept). ``flush`` writes them:
                before this thread waits for input, at each watcher's look while a
                request runs (one ``poll`` at most behind a long one), at the end.
        """
        self._handle = handle
        self._expired = expired
        self._write = write
        self._on_frame = on_frame
        self._own_frame = on_frame if own_frame is None else own_frame
        self._reader = reader
        self._on_eof = on_eof
        self._eof_told = False
        self._poll = poll
        self._interrupt = interrupt
        self._failed = failed
        self._hold = hold
        self._flush = flush
        self._holding = False  # this thread held a reply since it last flushed
        self._queue: deque[Request] = deque()
        # The condition's lock, entered directly where no wait or notify follows: `with` on a
        # Condition is a Python-level call (three a request), on the RLock a C one.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._running: Request | None = None
        self._started = 0  # requests started so far: the watcher's clock
        self._began = 0.0  # time.monotonic() when the running request began (for pong)
        self._role = ROLE_NOBODY
        self._want_back = False
        self._urgent = False  # the running request waits for a frame: read at once
        self._watcher_wake = threading.Event()
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        #: The execution thread (set by :meth:`run` or :meth:`start`).
        self.thread: threading.Thread | None = None
        #: Set once :meth:`run` has returned (``final`` included).
        self.done = threading.Event()

    def run(self, final: Callable[[], None] | None = None) -> None:
        """Run requests on this thread until EOF or :meth:`stop`; then ``final``."""
        self.thread = threading.current_thread()
        try:
            reading = False
            while True:
                request = self._next(reading)
                if request is None:
                    break
                reading = self._execute(request)
                # Not kept while the next frame is awaited: its arguments (a large
                # tensor, say) would live on until then.
                del request
        finally:
            try:
                self._flush()
                if final is not None:
                    final()
            finally:
                self.done.set()

    def start(self, final: Callable[[], None] | None = None) -> threading.Thread:
        """:meth:`run` on a new (daemon) thread, returned."""
        thread = threading.Thread(
            target=self.run, args=(final,), name="vllm-bridge-exec", daemon=True
        )
        self.thread = thread
        thread.start()
        return thread

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

    # -- the execution thread ------------------------------------------------------------

    def _execute(self, request: Request) -> bool:
        """Run ``request`` and send its reply; True when this thread took the reading
        role back as the request ended (see :meth:`_next`)."""
        reply = None
        escaped: BaseException | None = None
        try:
            late = None if request.deadline is None else self._began - request.deadline
            if late is not None and late >= 0:
                reply = self._expired(
                    request,
                    DeadlineExceeded(
                        f"{request.kind} {request.id} was not started: its deadline "
                        f"passed {late * 1000:.0f} ms before its turn came"
                    ),
                )
            else:
                reply = self._handle(request)
        except BaseException as exc:  # noqa: BLE001 - the handler answers its own errors;
            # this is a last guard, and the request is answered all the same.
            escaped = exc
            reply = self._last_resort(request, exc)
        finally:
            with self._lock:
                self._running = None
                # _next's first look, taken in this same hold of the lock (one lock a
                # request fewer): nothing queued and nobody reading, so this thread
                # reads next. Its reply is still written first, as before.
                reading = (
                    not self._stopping and not self._queue and self._role == ROLE_NOBODY
                )
                if reading:
                    self._role = ROLE_EXEC
        if reply is not None:
            # Held while the next request is read already (by this thread: it reads next).
            hold = reading and self._hold is not None and self._reader.has_frame()
            if hold and self._hold(reply):
                self._holding = True
            else:
                self._write(reply)
        if escaped is not None and not isinstance(escaped, Exception):
            raise escaped  # KeyboardInterrupt, SystemExit: answered, then let through
        return reading

    def _last_resort(self, request: Request, exc: BaseException) -> Any:
        """The error reply of a request whose handler raised (never raises itself)."""
        what = f"{python_type_name(exc)}: {safe_str(exc)[:2000]}"
        try:
            _log.error(
                "request %s %s failed outside its handler: %s",
                request.kind, request.id, what, exc_info=exc,
            )
        except BaseException:  # noqa: BLE001 - logging must not keep the answer back
            pass
        if self._failed is None:
            return None
        try:
            return self._failed(
                request,
                f"{request.kind} {request.id} failed inside the worker, outside the code "
                f"it ran ({what}); the worker goes on",
            )
        except BaseException:  # noqa: BLE001
            _log.exception("the error reply of request %s could not be made", request.id)
            return None

    def _begin(self, request: Request) -> Request:
        # Under the lock. An urgency left by the previous request is not this one's.
        self._began = time.monotonic()  # also the clock of _execute's deadline check
        self._running = request
        self._started += 1
        self._urgent = False
        return request

    def _next(self, reading: bool = False) -> Request | None:
        """The next request to run: from the queue, or read from fd 3 by this thread.
        ``reading``: this thread took the reading role already (:meth:`_execute`); a
        stop that came since is seen here, as the first look would have seen it."""
        if reading:
            if self._stopping:
                return None
        else:
            with self._lock:
                while True:
                    if self._stopping:
                        return None
                    if self._queue:
                        self._want_back = False
                        return self._begin(self._queue.popleft())
                    if self._role == ROLE_NOBODY:
                        self._role = ROLE_EXEC
                        break
                    if self._role == ROLE_WATCH and not self._want_back:
                        self._want_back = True
                        self._wake()
                    self._cond.wait()
        while True:
            if self._holding and not self._reader.has_frame():
                self._holding = False
                self._flush()  # before this thread waits for input
            body = self._read()
            if body is None:
                return None
            request = self._own_frame(body)
            if request is None:
                continue
            with self._lock:
                if self._stopping:
                    return None
                self._role = ROLE_NOBODY
                return self._begin(request)


def _stop_flow(request: Request) -> None:
    """A stream waiting for credit stops waiting (it was cancelled, or the input ended)."""
    if request.flow is not None:
        request.flow.stop()
