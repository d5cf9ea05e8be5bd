"""Flow control of a stream: a stream sends at most :data:`STREAM_WINDOW` chunks ahead of
what its consumer has read, so a fast generator cannot fill a slow consumer's mailbox.

The consumer gives room back with ``credit`` messages (``["credit", id, n]``: ``n`` more
chunks); the Elixir side sends one every :data:`STREAM_WINDOW` / 2 chunks it reads (see
docs/PROTOCOL.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

#: Chunks a stream may send before its first credit.
STREAM_WINDOW = 32


class Flow:
    """The room of one stream. The execution thread takes room for each chunk (waiting
    while there is none); the reading thread grants credits, or stops the stream.

    ``others_waiting`` says whether requests wait behind the stream: then it does not wait
    for room (its reader may be waiting for one of them: a call per chunk, two streams
    read in step), and runs on as it would without flow control. :meth:`nudge` makes a
    waiting :meth:`take` look again.

    ``before_wait`` is called (without this flow's lock) each time :meth:`take` is about
    to wait: the credit it waits for only comes if somebody reads the input, and the
    worker uses it to hand that role to its watcher at once (see
    :meth:`vllm_bridge.bridge.worker.executor_control.ExecutorControl.open_flow`).
    """

    def __init__(
        self,
        window: int,
        *,
        others_waiting: Callable[[], bool],
        before_wait: Callable[[], None],
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        self._cond = threading.Condition()
        self._room = window
        self._stopped = False
        self._others_waiting = others_waiting
        self._before_wait = before_wait

    def grant(self, n: int) -> None:
        """Room for ``n`` more chunks."""
        with self._cond:
            self._room += n
            self._cond.notify_all()

    def stop(self) -> None:
        """Wake a waiting :meth:`take` for good (the stream was cancelled or the input ended)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def nudge(self) -> None:
        """Make a waiting :meth:`take` look again (a request was queued behind the stream)."""
        with self._cond:
            self._cond.notify_all()

    def take(self) -> bool:
        """Take room for one chunk, waiting until there is some (or until requests wait
        behind the stream); False once stopped."""
        with self._cond:
            if self._may_go():
                return self._go()
        self._before_wait()  # outside the lock: the worker's hook takes the executor's
        with self._cond:
            while not self._may_go():
                self._cond.wait()
            return self._go()

    def _may_go(self) -> bool:
        return self._room > 0 or self._stopped or self._others_waiting()

    def _go(self) -> bool:
        if self._stopped:
            return False
        self._room -= 1
        return True
