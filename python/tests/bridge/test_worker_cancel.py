"""Cancel in place, against a real worker: a cancelled request's code is interrupted (a
Python loop, a blocking call, a stream between or inside chunks), the worker and every
session's state stay, and the next request runs at once; code stuck in C is interrupted
when it returns; code that swallows the interruption runs on; EOF interrupts too."""

from __future__ import annotations

import random
import subprocess
import threading
import time

import pytest
from conftest import FRAME_WAIT, next_id, spawn_worker

D = "vllm_bridge.bridge.diag"
INTERRUPTED = "vllm_bridge.bridge.protocol.errors.CallInterrupted"
#: Long enough that code which was not interrupted fails the test by answering ``ok``.
LONG_S = 20.0


#: Test code the worker runs (this directory on its PYTHONPATH): ``stuck``, ``log_loop``.
SUPPORT = "cancel_support"


def send(w, kind, path, args, session=None, timeout=60_000, module=D) -> int:
    rid = next_id()
    w.send([kind, rid, session, timeout, ["m", module, path], args, {}])
    return rid


def spawn_support_worker(stderr=None):
    """A worker that also allow-lists :data:`SUPPORT`."""
    return spawn_worker(["--allow", D, SUPPORT], stderr=stderr, support=True)


@pytest.fixture(scope="module")
def support_worker():
    w = spawn_support_worker()
    try:
        yield w
    finally:
        w.stop()


def wait_running(w, rid) -> None:
    for _ in range(10_000):
        if w.ping()["running"] == rid:
            return
    raise AssertionError(f"request {rid} never ran")


def assert_cancelled(w, rid) -> dict:
    kind, got, err = w.reply(rid)
    assert (kind, got, err["type"]) == ("error", rid, "cancelled"), err
    return err


def test_a_long_python_loop_is_interrupted_and_its_session_goes_on(shared_worker):
    w = shared_worker
    w.call(D, "exit_log", True)
    assert w.call(D, "set_var", "kept", session="c-loop") is None
    assert w.call(D, "set_var", "other", session="c-other") is None
    rid = send(w, "call", "spin", [LONG_S], session="c-loop")
    wait_running(w, rid)
    w.send(["cancel", rid])
    err = assert_cancelled(w, rid)
    assert f"call {rid} was interrupted: its caller gave up" in err["message"]
    # The same process, both sessions' state intact, nothing left running.
    assert w.call(D, "get_var", session="c-loop") == "kept"
    assert w.call(D, "get_var", session="c-other") == "other"
    assert w.call(D, "info")["pid"] == w.hello["pid"]
    assert w.call(D, "exit_log") == [
        {"name": "spin", "type": INTERRUPTED, "message": err["message"]}
    ]
    assert w.ping()["running"] is None


def test_a_blocking_call_is_interrupted(shared_worker):
    w = shared_worker
    rid = send(w, "call", "sleep", [LONG_S], session="c-sleep")
    wait_running(w, rid)
    w.send(["cancel", rid])
    assert_cancelled(w, rid)
    assert w.call(D, "add", 1, 2, session="c-sleep") == 3


def test_a_stream_cancelled_inside_a_chunk_stops_and_the_session_streams_again(shared_worker):
    w = shared_worker
    w.call(D, "exit_log", True)
    rid = send(w, "stream", "count", [3, 0.0], session="c-stream")
    assert [w.reply(rid) for _ in range(4)] == [
        ["chunk", rid, 0], ["chunk", rid, 1], ["chunk", rid, 2], ["end", rid]
    ]
    # Its generator waits LONG_S before its first item: cancelled while computing it.
    rid = send(w, "stream", "count", [3, LONG_S, "inside"], session="c-stream")
    wait_running(w, rid)
    w.send(["cancel", rid])
    assert_cancelled(w, rid)
    log = w.call(D, "exit_log", True)
    assert [(e["name"], e["type"]) for e in log] == [("inside", INTERRUPTED)]
    assert w.stream(["m", D, "count"], [2], session="c-stream") == [0, 1]


def test_code_stuck_in_c_is_interrupted_only_when_it_returns(support_worker):
    w = support_worker
    rid = send(w, "call", "stuck", [1.0], session="c-stuck", module=SUPPORT)
    wait_running(w, rid)
    w.send(["cancel", rid])
    # The cancel has been read (the watcher reads in order) and the request runs on.
    assert w.ping()["running"] == rid
    assert_cancelled(w, rid)  # not its value: interrupted once it returned
    assert w.call(D, "add", 2, 2, session="c-stuck") == 4


def test_code_that_swallows_the_interruption_runs_on_and_is_interrupted_once(shared_worker):
    w = shared_worker
    w.call(D, "exit_log", True)
    rid = send(w, "call", "spin", [0.5, 0.0, True])
    wait_running(w, rid)
    for _ in range(5):
        w.send(["cancel", rid])
    kind, got, turns = w.reply(rid)
    assert (kind, got) == ("ok", rid) and turns > 0
    log = w.call(D, "exit_log")
    assert [(e["name"], e["type"]) for e in log] == [
        ("spin swallowed", INTERRUPTED),
        ("spin", None),
    ]


def test_the_cleanup_of_interrupted_code_runs_to_its_end_under_more_cancels(shared_worker):
    w = shared_worker
    w.call(D, "exit_log", True)
    rid = send(w, "call", "spin", [LONG_S, 0.5])
    wait_running(w, rid)
    for _ in range(5):
        w.send(["cancel", rid])
        w.ping()
    assert_cancelled(w, rid)
    log = w.call(D, "exit_log")
    assert [(e["name"], e["type"]) for e in log] == [("spin", INTERRUPTED), ("spin cleanup", None)]


def test_a_cancel_of_a_finished_request_changes_nothing(shared_worker):
    w = shared_worker
    rid = send(w, "call", "set_var", ["v"], session="c-done")
    assert w.reply(rid) == ["ok", rid, None]
    w.send(["cancel", rid])
    w.send(["cancel", rid])
    assert w.call(D, "get_var", session="c-done") == "v"
    assert w.inbox == []


def test_cancels_at_random_moments_leave_the_worker_and_its_sessions_as_they_were(
    shared_worker,
):
    """Calls and streams of a session, each cancelled at a random moment (before it
    starts, while it runs, as it ends, after it ended, twice): every request gets exactly
    one final answer, its value or ``cancelled``; then the session's variable, the
    worker's process and its reference count are as before."""
    w = shared_worker
    rng = random.Random(1313)
    session = "c-fuzz"
    assert w.call(D, "set_var", "fuzz", session=session) is None
    refs = w.ping()["refs"]
    outcomes = {"ok": 0, "cancelled": 0}
    for _ in range(150):
        pick = rng.random()
        if pick < 0.5:
            seconds = rng.choice([0.0, 0.001, 0.003, 0.01])
            rid = send(w, "call", "spin", [seconds], session=session)
            answered = lambda f: f[0] == "ok" and isinstance(f[2], int)  # noqa: E731
        elif pick < 0.8:
            rid = send(w, "call", "get_var", [], session=session)
            answered = lambda f: f[0] == "ok" and f[2] == "fuzz"  # noqa: E731
        else:
            rid = send(w, "stream", "count", [3, 0.002], session=session)
            answered = lambda f: f[0] == "end"  # noqa: E731
        delay = rng.choice([0.0, 0.0, 0.0005, 0.002, 0.005, 0.02])
        if delay:
            time.sleep(delay)
        for _ in range(rng.choice([1, 1, 2])):
            w.send(["cancel", rid])
        while True:
            frame = w.reply(rid)
            if frame[0] != "chunk":
                break
        if frame[0] == "error":
            assert frame[2]["type"] == "cancelled", frame
            outcomes["cancelled"] += 1
        else:
            assert answered(frame), frame
            outcomes["ok"] += 1
    assert outcomes["ok"] > 0 and outcomes["cancelled"] > 0, outcomes
    assert w.call(D, "get_var", session=session) == "fuzz"
    assert w.call(D, "info")["pid"] == w.hello["pid"]
    status = w.ping()
    assert (status["running"], status["queued"], status["refs"]) == (None, 0, refs)
    assert w.inbox == []


def test_eof_interrupts_the_running_request_then_exits_the_contexts():
    w = spawn_worker(stderr=subprocess.PIPE)
    try:
        w.call(D, "recorder", "held", session="c-eof", via="enter")
        rid = send(w, "call", "spin", [LONG_S * 10], session="c-eof")
        wait_running(w, rid)
        w.close()
        assert w.proc.wait(timeout=FRAME_WAIT) == 0
        log = w.proc.stderr.read().decode()
        # Interrupted: the grace after EOF was not needed.
        assert "fd 3 closed; exited 1 contexts of 1 sessions" in log, log
        assert "did not stop when interrupted" not in log, log
    finally:
        w.stop()


def test_eof_while_a_request_is_stuck_exits_after_the_grace():
    w = spawn_support_worker(stderr=subprocess.PIPE)
    try:
        rid = send(w, "call", "stuck", [LONG_S * 10], module=SUPPORT)
        wait_running(w, rid)
        w.close()
        assert w.proc.wait(timeout=FRAME_WAIT) == 0
        log = w.proc.stderr.read().decode()
        assert f"fd 3 closed while request {rid} runs (it did not stop when interrupted)" in log
    finally:
        w.stop()


def test_an_interruption_never_cuts_a_log_frame_the_code_is_writing():
    """The code logs large records without pause while its reader is slow (the pipe
    fills, so frames are written in several steps): cancels land during those writes,
    and every frame still arrives whole."""
    w = spawn_support_worker()
    # A cut frame would leave this reader waiting for bytes that never come: the worker
    # is killed after a while, so that the test fails instead of hanging.
    watchdog = threading.Timer(FRAME_WAIT, w.proc.kill)
    watchdog.start()
    try:
        for round_ in range(8):
            rid = next_id()
            target = ["m", SUPPORT, "log_loop"]
            w.send(["call", rid, None, 60_000, target, [LONG_S, 256 * 1024], {}])
            wait_running(w, rid)
            time.sleep(0.05)  # let the pipe fill: the worker is blocked in a write
            w.send(["cancel", rid])
            assert_cancelled(w, rid)  # every frame before it decoded whole
            assert w.call(D, "add", round_, 1) == round_ + 1
        assert w.logs and all(len(m[3]) > 256 * 1024 for m in w.logs)
    finally:
        watchdog.cancel()
        w.stop()
