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
* a stream about to wait for credit (``Executor.open_flow``, in
  :mod:`~vllm_bridge.bridge.worker.executor_control`) wakes the watcher, which takes the
  role at once: the credit is in the input, and nobody else reads it;
* when the execution thread finds its queue empty while the watcher reads, it asks for
  the role back (a byte on a wake-up pipe interrupts the watcher's ``select``) and reads
  again itself.

A request whose deadline passed before its turn is answered with a ``timeout`` error and
not started. A queued request can be cancelled (it is dropped; the caller answers it); a
running one is marked and interrupted (the ``interrupt`` hook: its code stops where it
is; a stream also stops at its next chunk; an ``enter`` exits the context again once
``__enter__`` returns). The end of the input (or :meth:`Executor.stop`) does the same to
the running request.

This module is the execution thread's own loop (the per-request path: :meth:`Executor.run`,
``_next``, ``_begin``, ``_execute``); what the other threads call (queueing, cancel,
credit, stop, the status) is in :mod:`~vllm_bridge.bridge.worker.executor_control`, and
the watcher's loop in :mod:`~vllm_bridge.bridge.worker.watcher`; :class:`Executor`
derives from both.
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
from vllm_bridge.bridge.protocol.framing import FrameReader
from vllm_bridge.bridge.protocol.messages import Request
from vllm_bridge.bridge.worker.executor_control import ExecutorControl
from vllm_bridge.bridge.worker.watcher import POLL_SECONDS, ROLE_EXEC, ROLE_NOBODY, ROLE_WATCH

_log = logging.getLogger("vllm_bridge.bridge.worker")


class Executor(ExecutorControl):
    """One execution thread; the reading role shared with the watcher
    (:class:`~vllm_bridge.bridge.worker.watcher.Watcher`); what the other threads call
    (queue, cancel, credit, stop, status) in
    :class:`~vllm_bridge.bridge.worker.executor_control.ExecutorControl`."""

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
        ended: Callable[[], None] | None = None,
        unhandled: Callable[[bytearray | memoryview, Exception], None] | None = None,
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
            ended: Called on the execution thread after each request, once every frame
                that ran it has ended (the worker's journal of exceptions lets go of
                their locals: ``Sessions.release_locals``).
            unhandled: Answers a frame whose ``on_frame`` (or ``own_frame``) raised after
                all, with what it raised (the worker: an error under the id read from the
                frame's first bytes); the thread that read it reads on. ``None``: logged.
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
        self._ended = ended
        self._unhandled = unhandled
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
        ended = self._ended
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
                if ended is not None:
                    ended()
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
            try:
                request = self._own_frame(body)
            except Exception as exc:  # a last guard (on_frame answers its own): read on
                self._frame_failed(body, exc)
                continue
            if request is None:
                continue
            with self._lock:
                if self._stopping:
                    return None
                self._role = ROLE_NOBODY
                return self._begin(request)
