"""The interrupter in this process (pytest runs tests on the main thread, where Python runs
signal handlers): what a cancel interrupts, what it never does, and its races.

A second thread plays the watcher: it marks the request cancelled and signals the main
thread, as :meth:`vllm_bridge.bridge.worker.executor_control.ExecutorControl.cancel` does.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from vllm_bridge.bridge import diag
from vllm_bridge.bridge.protocol.errors import CallInterrupted, Cancelled
from vllm_bridge.bridge.protocol.messages import Invoke
from vllm_bridge.bridge.worker.interrupt import Interrupter, Interruptible

#: Long enough that a wait which was not interrupted fails the test by returning.
LONG_S = 30.0


def request(rid: int = 1) -> Invoke:
    return Invoke("call", rid, None, None)


def cancel_later(
    it: Interrupter, req: Invoke, after: float = 0.05, times: int = 1
) -> threading.Thread:
    """As the watcher does on ``cancel``: mark, then signal (``times`` times, 10 ms apart)."""

    def run() -> None:
        time.sleep(after)
        req.cancelled = True
        for _ in range(times):
            it.interrupt()
            time.sleep(0.01)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def blocked(what: str) -> Callable[[], Any]:
    """A call that blocks for LONG_S seconds in ``what`` unless it is interrupted."""
    if what == "sleep":
        return lambda: time.sleep(LONG_S)
    if what == "lock":
        lock = threading.Lock()
        lock.acquire()
        return lambda: lock.acquire(timeout=LONG_S)
    if what == "event":
        return lambda: threading.Event().wait(LONG_S)
    if what == "spin":
        return lambda: diag.spin(LONG_S)
    raise ValueError(what)


@pytest.mark.parametrize("what", ["sleep", "lock", "event", "spin"])
def test_a_cancel_interrupts_a_python_loop_and_blocking_calls(interrupter, what):
    req = request()
    fn = blocked(what)
    thread = cancel_later(interrupter, req)
    with pytest.raises(Cancelled, match="call 1 was interrupted: its caller gave up"):
        Interruptible(interrupter, req).call(fn)
    thread.join()


def test_a_request_cancelled_before_its_code_starts_never_runs_it(interrupter):
    req = request()
    req.cancelled = True
    ran = []
    with pytest.raises(Cancelled):
        Interruptible(interrupter, req).call(ran.append, 1)
    assert ran == []


def test_a_signal_does_nothing_unless_the_armed_request_is_cancelled(interrupter):
    # Nothing armed: a sleep on the main thread is woken by the signal and goes on.
    thread = cancel_later(interrupter, request(9), after=0.02, times=5)
    time.sleep(0.2)
    thread.join()
    # Armed, but its request is not the cancelled one: it runs to its end.
    req = request(2)
    other = request(3)
    thread = cancel_later(interrupter, other, after=0.02, times=5)
    assert Interruptible(interrupter, req).call(lambda: time.sleep(0.2) or "done") == "done"
    thread.join()


def test_at_most_once_per_request_and_cleanup_runs_undisturbed(interrupter):
    diag.exit_log(clear=True)
    req = request()
    # Cancels keep coming (20 signals) while the code swallows the first interruption and
    # goes on: it is never interrupted again, and returns normally.
    thread = cancel_later(interrupter, req, times=20)
    assert Interruptible(interrupter, req).call(diag.spin, 0.5, swallow=True) > 0
    thread.join()
    swallowed = [e for e in diag.exit_log() if e["name"] == "spin swallowed"]
    assert [e["type"] for e in swallowed] == ["vllm_bridge.bridge.protocol.errors.CallInterrupted"]

    # The cleanup of interrupted code (its finally, a sleep) runs to its end while
    # further signals arrive.
    diag.exit_log(clear=True)
    req = request(2)
    thread = cancel_later(interrupter, req, times=20)
    with pytest.raises(Cancelled):
        Interruptible(interrupter, req).call(diag.spin, LONG_S, cleanup=0.2)
    thread.join()
    assert [e["name"] for e in diag.exit_log()] == ["spin", "spin cleanup"]


def test_an_interruption_waits_while_held_and_comes_when_the_block_ends(interrupter):
    req = request()
    reached = []

    def code() -> None:
        with interrupter.held():
            req.cancelled = True
            interrupter.interrupt()  # handled right here, inside the block: deferred
            time.sleep(0.05)
            reached.append("end of block")
        reached.append("after the block")

    with pytest.raises(Cancelled):
        Interruptible(interrupter, req).call(code)
    assert reached == ["end of block"]


def test_a_held_block_on_another_thread_does_not_hold_the_main_one(interrupter):
    req = request()
    inside = threading.Event()
    leave = threading.Event()

    def other() -> None:
        with interrupter.held():
            inside.set()
            leave.wait(LONG_S)

    t = threading.Thread(target=other, daemon=True)
    t.start()
    inside.wait(LONG_S)
    try:
        thread = cancel_later(interrupter, req)
        with pytest.raises(Cancelled):
            Interruptible(interrupter, req).call(time.sleep, LONG_S)
        thread.join()
    finally:
        leave.set()
        t.join()


def test_an_interruption_kept_and_raised_by_a_later_request_is_not_that_ones_cancel(
    interrupter,
):
    kept: list[BaseException] = []
    first = request(1)

    def keep() -> None:
        try:
            time.sleep(LONG_S)
        except CallInterrupted as exc:
            kept.append(exc)

    thread = cancel_later(interrupter, first)
    Interruptible(interrupter, first).call(keep)
    thread.join()

    def reraise() -> None:
        raise kept[0]

    with pytest.raises(CallInterrupted):
        Interruptible(interrupter, request(2)).call(reraise)


def test_no_interruption_outside_a_guard_after_a_race_fuzz(interrupter):
    """Signals land at random moments while short guarded calls start and end: each call
    returns its value or raises Cancelled (only when its request was cancelled), and no
    interruption ever escapes into the code around the calls (this test's own loop)."""
    rng = random.Random(13)
    current: list[Invoke | None] = [None]
    stop = threading.Event()

    def watcher() -> None:
        while not stop.is_set():
            req = current[0]
            if req is not None and rng.random() < 0.5:
                req.cancelled = True
            interrupter.interrupt()
            time.sleep(rng.random() * 0.0005)

    def work(n: int) -> int:
        total = 0
        for i in range(n):
            total += i
        if n % 3 == 0:
            time.sleep(0.0002)
        return total

    outcomes = {"value": 0, "cancelled": 0}
    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    try:
        for rid in range(3000):
            req = request(rid)
            current[0] = req
            n = rng.randrange(0, 400)
            try:
                got = Interruptible(interrupter, req).call(work, n)
            except Cancelled:
                assert req.cancelled
                outcomes["cancelled"] += 1
            else:
                assert got == n * (n - 1) // 2
                outcomes["value"] += 1
            current[0] = None
    finally:
        stop.set()
        thread.join()
    # Both outcomes happened: the fuzz reached both sides of the race.
    assert outcomes["value"] > 0 and outcomes["cancelled"] > 0, outcomes


def test_install_only_on_the_main_thread():
    errors: list[BaseException] = []

    def install() -> None:
        try:
            Interrupter().install()
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=install)
    t.start()
    t.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])
    assert not Interrupter().installed
    Interrupter().interrupt()  # not installed: signals nobody
