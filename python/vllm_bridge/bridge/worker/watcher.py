"""The watcher: the thread that takes the reading role while a request runs.

Part of :class:`~vllm_bridge.bridge.worker.executor.Executor` (see its module for who
reads fd 3 when): :class:`Watcher` holds the watcher's loop, and the executor, which
derives from it (through :class:`~vllm_bridge.bridge.worker.executor_control.ExecutorControl`,
what the other threads call), the state it reads (the lock, the running request, the
role). Apart so that each part reads on its own: the execution thread there, the watcher
here (with the reading both threads do: one frame, the end of the input, the wake-up pipe).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm_bridge.bridge.protocol.framing import FrameError, FrameReader
from vllm_bridge.bridge.protocol.messages import Request

_log = logging.getLogger("vllm_bridge.bridge.worker")

#: Seconds between two looks of the watcher at the running request.
POLL_SECONDS = 0.002
#: Seconds between two looks while no request has run for a while (an idle worker).
IDLE_POLL_SECONDS = 0.05
#: Seconds of idleness after which the reader's buffer for large frames is dropped
#: (:meth:`~vllm_bridge.bridge.protocol.framing.FrameReader.release`): kept while requests
#: keep coming (a large read into pages that exist is about twice as fast), not for good.
IDLE_RELEASE_SECONDS = 1.0

# Who reads fd 3: nobody (the execution thread runs what it read), the execution thread,
# or the watcher.
ROLE_NOBODY, ROLE_EXEC, ROLE_WATCH = 0, 1, 2


class Watcher:
    """The watcher's loop (:meth:`watch`), over the state of the
    :class:`~vllm_bridge.bridge.worker.executor.Executor` that derives from it."""

    # Set by Executor.__init__ (see there); declared here for what reads them.
    _cond: threading.Condition
    _lock: Any  # the RLock under _cond (threading.RLock is a factory, not a type)
    _running: Request | None
    _started: int
    _role: int
    _want_back: bool
    _urgent: bool
    _stopping: bool
    _watcher_wake: threading.Event
    _wake_r: int
    _poll: float
    _reader: FrameReader
    _on_frame: Callable[[bytearray | memoryview], Request | None]
    _unhandled: Callable[[bytearray | memoryview, Exception], None] | None
    _on_eof: Callable[[], None]
    _eof_told: bool
    _wake_w: int
    _halt: Callable[..., bool]
    _flush: Callable[[], None]
    submit: Callable[[Request], None]

    def watch(self) -> None:
        """Run the watcher on this thread until EOF or :meth:`stop`."""
        seen = -1
        idle = 0
        active = time.monotonic()  # when a request last ran or started, as seen here
        released = True
        while True:
            with self._lock:
                if self._stopping:
                    return
                running = self._running is not None
                take = running and self._role == ROLE_NOBODY and (
                    self._started == seen or self._urgent
                )
                started_since = self._started != seen
                seen = self._started
                if take:
                    self._role = ROLE_WATCH
            if running:
                # Replies held behind the running request go out at every look: at most
                # one poll late (Executor's `hold`).
                self._flush()
            if take:
                if not self._read_as_watcher():
                    return
                idle = 0
                continue
            # Every poll while a request runs; backing off to IDLE_POLL_SECONDS while
            # none does, so an idle worker wakes about 20 times a second, not 500.
            idle = 0 if running else idle + 1
            now = time.monotonic()
            if running or started_since:
                active, released = now, False
            elif not released and now - active >= IDLE_RELEASE_SECONDS:
                # Idle a while: the buffer a large frame was read into goes (see
                # FrameReader.release; the next large frame makes a new one).
                released = True
                self._reader.release()
            self._watcher_wake.wait(self._poll if idle < 8 else max(self._poll, IDLE_POLL_SECONDS))
            self._watcher_wake.clear()

    def _read_as_watcher(self) -> bool:
        """Read frames until the execution thread wants the role back (True) or EOF (False)."""
        while True:
            if not self._reader.has_frame():
                ready, _, _ = select.select([self._reader.fd, self._wake_r], [], [])
                if self._wake_r in ready:
                    os.read(self._wake_r, 512)
            else:
                ready = [self._reader.fd]
            if self._reader.fd in ready:
                body = self._read()
                if body is None:
                    return False
                try:
                    request = self._on_frame(body)
                except Exception as exc:  # a last guard (on_frame answers its own)
                    self._frame_failed(body, exc)
                    request = None
                # Neither may live on in this loop until the next frame arrives: a large
                # body holds its own buffer, a request its decoded arguments.
                del body
                if request is not None:
                    self.submit(request)
                    del request
            with self._lock:
                if self._stopping:
                    return False
                if self._want_back:
                    self._want_back = False
                    self._role = ROLE_NOBODY
                    self._cond.notify_all()
                    return True

    # -- both threads ------------------------------------------------------------------

    def _frame_failed(self, body: bytearray | memoryview, exc: Exception) -> None:
        """Answer a frame whose handler raised ``exc`` (the executor's ``unhandled``), or
        log it: the thread that read it must read on, whatever the frame held.
        KeyboardInterrupt and SystemExit are not caught on the way here."""
        try:
            if self._unhandled is not None:
                self._unhandled(body, exc)
                return
        except Exception as failed:  # noqa: BLE001 - logged below, with what it answered
            _log.error("the frame's error reply could not be made: %r", failed)
        _log.error("a frame of %d bytes could not be handled", len(body), exc_info=exc)

    def _read(self) -> bytearray | memoryview | None:
        """One frame; on EOF or a broken stream: stop (once) and return ``None``."""
        try:
            body = self._reader.read_frame()
        except FrameError as exc:
            # Ends the worker as EOF does. Logged once the output is closed (on_eof), so
            # that the record goes to stderr rather than to the peer that broke the stream,
            # and before the halt: the halt lets the main thread finish and the process
            # exit, which a record still to be written by this (daemon) thread would miss.
            self._tell_eof()
            _log.error("input stream broken: %s", exc)
            self._halt(eof=True)
            return None
        if body is None:
            self._halt(eof=True)
        return body

    def _tell_eof(self) -> None:
        # on_eof, once, whichever thread gets here first.
        with self._lock:
            told, self._eof_told = self._eof_told, True
        if not told:
            self._on_eof()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full of wake-ups already
            pass
