"""Where a cancel's interruption may land, at the edges (docs/PROTOCOL.md, "Cancel";
python/vllm_bridge/bridge/worker/interrupt.py):

* the signal is sent under the executor's lock, only while the cancelled request is still
  the running one, so it cannot be sent after the thread has moved on to the next
  request (whose blocking call it would interrupt with ``EINTR``);
* an interruption never raises inside :mod:`logging`'s own code, where it could leave
  logging's module lock held (the worker's next log call would wait for good): it is
  tried again once the code has left logging.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest
from conftest import FRAME_WAIT, WorkerProc, next_id, spawn_worker

from vllm_bridge.bridge.protocol.errors import CallInterrupted
from vllm_bridge.bridge.protocol.framing import FrameReader, write_frame
from vllm_bridge.bridge.protocol.messages import Invoke
from vllm_bridge.bridge.worker.executor import Executor
from vllm_bridge.bridge.worker.interrupt import INTERRUPT_SIGNAL, RETRY_SECONDS, Interruptible

D = "vllm_bridge.bridge.diag"


# -- the signal is sent under the executor's lock --------------------------------------------


def test_the_signal_is_sent_while_the_cancelled_request_is_still_running() -> None:
    """In process: the ``interrupt`` hook runs with the executor's lock held (another
    thread cannot take it) and with the cancelled request still the running one."""
    read_fd, write_fd = os.pipe()
    seen: list[tuple[Any, bool]] = []
    started, release = threading.Event(), threading.Event()
    executor: Executor

    def handle(req: Invoke) -> Any:
        started.set()
        release.wait(FRAME_WAIT)
        return None

    def try_lock(free: list[bool]) -> None:
        got = executor._cond.acquire(False)
        if got:
            executor._cond.release()  # by the thread that took it (an RLock)
        free.append(got)

    def interrupt() -> None:
        free: list[bool] = []
        probe = threading.Thread(target=try_lock, args=(free,))
        probe.start()
        probe.join()
        seen.append((executor.running_id, free[0]))

    executor = Executor(
        handle, lambda _r, _e: None, lambda _reply: None,
        lambda body: Invoke("call", int(bytes(body)), None, None),
        FrameReader(fd=read_fd), interrupt=interrupt,
    )  # fmt: skip
    executor.start()
    try:
        write_frame(b"7", fd=write_fd)
        assert started.wait(FRAME_WAIT)
        assert executor.cancel(7) is None
        assert seen == [(7, False)]  # request 7 running, the lock not free
    finally:
        release.set()
        executor.stop()
        os.close(write_fd)
        os.close(read_fd)


# -- never inside logging --------------------------------------------------------------------


class _FrameCatcher(logging.Handler):
    """Keeps the frame that called its ``handle``: logging's own code."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[FrameType] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.frames.append(sys._getframe(2))  # emit <- Handler.handle <- callHandlers


def test_an_interruption_landing_in_logging_is_tried_again_later(interrupter) -> None:
    catcher = _FrameCatcher()
    logger = logging.getLogger("interrupt.window")
    logger.addHandler(catcher)
    try:
        logger.warning("x")
    finally:
        logger.removeHandler(catcher)
    [logging_frame] = catcher.frames
    assert logging_frame.f_globals["__name__"] == "logging"
    again: list[tuple[Any, float]] = []
    interrupter.again = lambda req, delay: again.append((req, delay))
    req = Invoke("call", 5, None, None)
    req.cancelled = True
    own = Interruptible(interrupter, req)
    interrupter._armed = own
    try:
        interrupter._on_signal(INTERRUPT_SIGNAL, logging_frame)  # deferred, not raised
        assert again == [(req, RETRY_SECONDS)] and not own.fired
        with pytest.raises(CallInterrupted):  # in the request's own frame: raised
            interrupter._on_signal(INTERRUPT_SIGNAL, sys._getframe())
        assert own.fired
    finally:
        interrupter._armed = None


@pytest.fixture
def w() -> Iterator[WorkerProc]:
    wp = spawn_worker(["--allow", D, "cancel_support"], support=True)
    # A logging lock left held would hang the worker: it is killed after a while, so that
    # the test fails instead of hanging.
    watchdog = threading.Timer(FRAME_WAIT * 2, wp.proc.kill)
    watchdog.start()
    try:
        yield wp
    finally:
        watchdog.cancel()
        wp.stop()


def test_code_that_calls_logging_without_pause_is_cancelled_and_logging_stays_free(w) -> None:
    for round_ in range(12):
        rid = next_id()
        w.send(["call", rid, None, 60_000, ["m", "cancel_support", "get_loggers"], [30.0], {}])
        end = time.monotonic() + FRAME_WAIT
        while w.ping()["running"] != rid:
            assert time.monotonic() < end
        time.sleep(0.02 * (round_ % 4))
        w.send(["cancel", rid])
        kind, got, err = w.reply(rid)
        assert (kind, got, err["type"]) == ("error", rid, "cancelled"), err
        assert w.call("cancel_support", "logging_lock_free") is True
        w.logs.clear()
        w.call(D, "log", f"round {round_}")
        assert [m[3] for m in w.logs] == [f"round {round_}"]
