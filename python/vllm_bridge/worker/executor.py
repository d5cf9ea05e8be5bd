"""The execution thread: requests run one at a time, in arrival order.

The reader thread :meth:`Executor.submit`\\ s requests and may :meth:`Executor.cancel` them:
a queued request is taken out of the queue (the reader answers it), a running one is
marked (a stream stops at its next chunk). A request whose deadline passed before it
reaches the front of the queue is answered with a ``timeout`` error and not started.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from vllm_bridge.protocol.errors import DeadlineExceeded
from vllm_bridge.protocol.messages import Request

_log = logging.getLogger("vllm_bridge.worker")


class Executor:
    """One execution thread fed by a FIFO queue."""

    def __init__(
        self,
        handle: Callable[[Request], Any],
        expired: Callable[[Request, DeadlineExceeded], Any],
        write: Callable[[Any], None],
    ) -> None:
        """
        Args:
            handle: Runs one request and returns its final reply, encoded; must not raise.
            expired: The reply of a request whose deadline passed before it started.
            write: Sends a reply. The final reply is sent after the request stops
                counting as running, so a ``pong`` never names a request already answered.
        """
        self._handle = handle
        self._expired = expired
        self._write = write
        self._queue: deque[Request] = deque()
        self._cond = threading.Condition()
        self._running: Request | None = None
        self._stopping = False
        self._final: Callable[[], None] | None = None
        self.thread = threading.Thread(target=self._run, name="vllm-bridge-exec", daemon=True)

    def start(self) -> None:
        """Start the execution thread."""
        self.thread.start()

    @property
    def running_id(self) -> int | None:
        """Id of the request running now, if any."""
        running = self._running
        return None if running is None else running.id

    @property
    def queued(self) -> int:
        """Number of requests waiting."""
        return len(self._queue)

    def submit(self, request: Request) -> None:
        """Queue ``request`` behind those already queued."""
        with self._cond:
            self._queue.append(request)
            self._cond.notify()

    def cancel(self, request_id: int) -> Request | None:
        """Cancel the request with this id.

        Returns:
            The request if it was still queued (it is removed and will not run; the
            caller answers it), else ``None`` (a running request is only marked).
        """
        with self._cond:
            for request in self._queue:
                if request.id == request_id:
                    self._queue.remove(request)
                    return request
            if self._running is not None and self._running.id == request_id:
                self._running.cancelled = True
        return None

    def stop(self, final: Callable[[], None] | None = None) -> None:
        """Drop the queue; after the running request (if any), run ``final`` and end."""
        with self._cond:
            self._queue.clear()
            self._stopping = True
            self._final = final
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    final = self._final
                    break
                request = self._running = self._queue.popleft()
            reply = None
            try:
                late = None if request.deadline is None else time.monotonic() - request.deadline
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
            except Exception:  # the handler answers its own errors; this is a last guard
                _log.exception("request %s %s failed outside its handler", request.kind, request.id)
            finally:
                with self._cond:
                    self._running = None
            if reply is not None:
                self._write(reply)
        if final is not None:
            final()
