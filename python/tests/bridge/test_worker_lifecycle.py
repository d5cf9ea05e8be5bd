"""How a worker ends: on EOF of fd 3 (even while a call runs) and when its parent dies."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import FRAME_WAIT, WorkerProc, next_id, spawn_worker

from vllm_bridge.bridge.worker.server import DEFAULT_MAX_REFS, parse_args

D = "vllm_bridge.bridge.diag"


def start_long_call(w: WorkerProc) -> int:
    rid = next_id()
    w.send(["call", rid, None, None, ["m", D, "sleep"], [120.0], {}])
    for _ in range(10_000):
        if w.ping()["running"] == rid:
            return rid
    raise AssertionError("the long call never started")


def wait_for_eof(fd: int) -> None:
    """Read ``fd`` until EOF: every writer of the pipe (the worker) is gone."""
    while True:
        ready, _, _ = select.select([fd], [], [], FRAME_WAIT)
        assert ready, "the worker kept its output open"
        if not os.read(fd, 65536):
            return


def test_eof_ends_the_worker_while_a_call_runs():
    w = spawn_worker()
    start_long_call(w)
    w.close()
    assert w.proc.wait(timeout=FRAME_WAIT) == 0


def test_eof_exits_the_contexts_still_entered_in_their_own_sessions():
    """The recorder resets a ContextVar token on exit, which fails (and is logged) unless
    the exit runs in the session's own context."""
    w = spawn_worker(stderr=subprocess.PIPE)
    try:
        for name, session in (("a", "eof-1"), ("b", "eof-1"), ("c", "eof-2")):
            w.call(D, "recorder", name, session=session, via="enter")
        w.close()
        assert w.proc.wait(timeout=FRAME_WAIT) == 0
        log = w.proc.stderr.read().decode()
        assert "fd 3 closed; exited 3 contexts of 2 sessions" in log
        assert "failed" not in log, log
    finally:
        w.stop()


MIDDLE = textwrap.dedent(
    """
    import os, subprocess, sys, threading, time

    fds = [int(x) for x in sys.argv[1:]]

    def spawn(r_in, w_out):
        def wire():
            a, b = os.dup(r_in), os.dup(w_out)
            while a < 5:
                a = os.dup(a)
            while b < 5:
                b = os.dup(b)
            os.dup2(a, 3)
            os.dup2(b, 4)

        return subprocess.Popen(
            [sys.executable, "-m", "vllm_bridge.bridge.worker"],
            preexec_fn=wire, pass_fds=(3, 4), close_fds=True,
        )

    def threads():
        with open(f"/proc/{os.getpid()}/status") as f:
            return int(f.read().split("Threads:")[1].split()[0])

    print(threads(), flush=True)
    spawn(fds[0], fds[1])  # single-threaded: the kernel's parent-death signal is armed
    sys.stdin.readline()  # the test has the first worker's hello
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    print(threads(), flush=True)
    spawn(fds[2], fds[3])  # two threads: only the worker's poll of its parent pid
    for fd in fds:
        os.close(fd)
    time.sleep(3600)
    """
)


def test_workers_exit_when_their_parent_dies_even_during_a_long_call():
    """A middle process starts two workers and is killed; this test holds the pipes
    (so the workers see no EOF) and waits for each worker's output to close.

    The first worker's parent had one thread, so the kernel kills it at once (SIGKILL,
    nothing printed); the second relies on its poll, which prints why it exits.
    """
    pipes = [os.pipe() for _ in range(4)]  # (to w1, from w1, to w2, from w2)
    child_fds = [pipes[0][0], pipes[1][1], pipes[2][0], pipes[3][1]]
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE]
        + [str(fd) for fd in child_fds],
        pass_fds=child_fds,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,  # the workers inherit it
    )
    for fd in child_fds:
        os.close(fd)
    workers = []
    try:
        for to_w, from_w in ((pipes[0][1], pipes[1][0]), (pipes[2][1], pipes[3][0])):
            threads = middle.stdout.readline()
            assert threads == f"{len(workers) + 1}\n".encode()  # of the middle at the spawn
            w = WorkerProc(proc=None, to_worker=to_w, from_worker=from_w)
            kind, w.hello = w.recv()  # the worker arms its lifeline before it says hello
            assert kind == "hello"
            workers.append(w)
            middle.stdin.write(b"go\n")
            middle.stdin.flush()
        for w in workers:
            start_long_call(w)
        middle.send_signal(signal.SIGKILL)
        middle.wait()
        for w in workers:
            wait_for_eof(w.from_worker)
            assert _wait_gone(w.hello["pid"])
        stderr = middle.stderr.read().decode()
        assert stderr.count("is gone; exiting") == 1, stderr
        assert f"worker {workers[1].hello['pid']}: parent process" in stderr
    finally:
        middle.kill()
        middle.wait()
        for stream in (middle.stdin, middle.stdout, middle.stderr):
            stream.close()
        for w in workers:
            w.close()
            if not _gone(w.hello["pid"]):
                os.kill(w.hello["pid"], signal.SIGKILL)


def _wait_gone(pid: int) -> bool:
    """Wait (up to FRAME_WAIT) for ``pid`` to end: its fds close before it is reaped."""
    deadline = time.monotonic() + FRAME_WAIT
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (gone, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_command_line_is_checked():
    opts = parse_args([])
    assert opts.max_refs == DEFAULT_MAX_REFS
    assert opts.allow[0] == D
    assert parse_args(["--allow", "a.b", "c", "--allow", "a.b"]).allow == ("a.b", "c")
    # --also-allow adds to the default list, or to --allow's, without repeats.
    from vllm_bridge import PUBLIC_MODULES

    assert parse_args(["--also-allow", "my_model"]).allow == (*PUBLIC_MODULES, "my_model")
    both = parse_args(["--allow", "a", "--also-allow", "b", "a"]).allow
    assert both == ("a", "b")
    assert opts.poll_us == 0
    assert parse_args(["--poll-us", "250"]).poll_us == 250
    for bad in (
        ["--max-refs", "0"],
        ["--allow", "not-a-module"],
        ["--also-allow", "my model"],
        ["--also-allow", "x."],
        ["--max-refs", "x"],
        ["--poll-us", "-1"],
        ["--poll-us", "10001"],
        ["--poll-us", "fast"],
    ):
        with pytest.raises(SystemExit) as info:
            parse_args(bad)
        assert info.value.code == 2


def test_a_polling_worker_serves_and_still_exits_on_eof():
    w = spawn_worker(["--poll-us", "2000"])
    try:
        assert w.hello["pid"] > 0
        for i in range(50):
            assert w.call(D, "add", i, 1) == i + 1
        rid = start_long_call(w)  # pings are still answered during a long call
        w.send(["cancel", rid])
        w.close()
        assert w.proc.wait(timeout=FRAME_WAIT) == 0
    finally:
        w.stop()
