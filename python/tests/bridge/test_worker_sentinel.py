"""The worker's sentinel (vllm_bridge.bridge.worker.sentinel): once the BEAM is gone it
ends the worker's process group, and nothing else; while the BEAM lives it ends nothing.

Every case runs a stand-in for a worker in a process of its own (a session and group of
its own, as an Erlang port's process is), and a ``sleep`` in place of the BEAM, so that
nothing here can signal the test run's own group. The whole worker over a real port,
with the BEAM killed by kill -9, is test/runtime/shutdown_test.exs.
"""

from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_bridge.bridge.worker import sentinel

SENTINEL = Path(sentinel.__file__)

# A worker's stand-in: starts the sentinel as the worker does (the module loaded by
# its path, without the package), a `sleep` in its group, and keeps an inheritable
# pipe open (a port's pipes are), then prints what it has and sleeps. With
# STAND_IN_CLOSED_STDIO its fds 0-2 are closed while it starts the sentinel.
STAND_IN = """
import importlib.util, os, subprocess, sys, time
sys.executable = os.environ.get("STAND_IN_EXE", sys.executable)
spec = importlib.util.spec_from_file_location("sentinel", sys.argv[1])
sentinel = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sentinel)
r, w = os.pipe()
os.set_inheritable(r, True)
os.set_inheritable(w, True)
if os.environ.get("STAND_IN_REAPER"):
    # spawn, then work that reaps any child that exited, then confirm: the worker
    # spawns first thing and confirms before its hello, its imports in between.
    spawned = sentinel.spawn()
    time.sleep(0.5)
    print(os.waitpid(-1, os.WNOHANG)[0] == spawned.pid, file=sys.stderr, flush=True)
    snt = spawned.confirm()
elif os.environ.get("STAND_IN_CLOSED_STDIO"):
    kept = os.dup(1), os.dup(2)
    for fd in (0, 1, 2):
        os.close(fd)
    snt = sentinel.start()
    os.dup2(kept[0], 1)
    os.dup2(kept[1], 2)
else:
    snt = sentinel.start()
child = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(snt, child.pid, os.environ.get(sentinel.ENV), os.getpid(), flush=True)
time.sleep(300)
"""

# The BEAM's erl_child_setup, as the sentinel knows it: by its name. It starts the
# stand-in in a session of its own, as it starts a port's process, and waits.
FAKE_SETUP = """
import ctypes, subprocess, sys
ctypes.CDLL(None).prctl(15, b"erl_child_setup", 0, 0, 0)
subprocess.Popen(sys.argv[1:], start_new_session=True).wait()
"""


def start_time(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rfind(b")") + 2 :].split()[19])


def wait_for(cond, what: str, seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, f"{what}: not within {seconds} s"
        time.sleep(0.02)


class Case:
    """A fake BEAM (a `sleep`) and a worker's stand-in that names it to its sentinel,
    started by a fake erl_child_setup with ``via_setup``."""

    def __init__(self, made: list[Case], session: str = "own", beam: str | None = None,
                 exe: str | None = None, via_setup: bool = False,
                 closed_stdio: bool = False, reaper: bool = False) -> None:
        made.append(self)  # closed after the test, whatever happens below
        self.worker = None
        self.child_id = self.interp_id = None
        self.via_setup = via_setup
        self.beam = subprocess.Popen(["sleep", "300"])
        self.beam_id = (self.beam.pid, start_time(self.beam.pid))
        env = dict(os.environ)
        env[sentinel.ENV] = beam or f"{self.beam_id[0]}:{self.beam_id[1]}"
        if exe is not None:
            env["STAND_IN_EXE"] = exe
        if closed_stdio:
            env["STAND_IN_CLOSED_STDIO"] = "1"
        if reaper:
            env["STAND_IN_REAPER"] = "1"
        argv = [sys.executable, "-c", STAND_IN, str(SENTINEL)]
        if via_setup:
            argv = [sys.executable, "-c", FAKE_SETUP, *argv]
        self.worker = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=session == "own" and not via_setup,
            preexec_fn=os.setpgrp if session == "group only" else None,
        )
        ready, _, _ = select.select([self.worker.stdout], [], [], 60)
        assert ready, "the stand-in said nothing within 60 s"
        snt, child, self.env_seen, interp = self.worker.stdout.readline().split()
        self.sentinel = None if snt == "None" else int(snt)
        self.interp = int(interp)
        self.interp_id = (self.interp, start_time(self.interp))
        self.child = int(child)
        self.child_id = (self.child, start_time(self.child))

    def kill_beam(self) -> None:
        self.beam.kill()
        self.beam.wait()

    def kill_worker(self) -> None:
        """The interpreter (the stand-in), with SIGKILL."""
        if self.via_setup:
            os.kill(self.interp, signal.SIGKILL)
            wait_for(lambda: gone(self.interp), "the stand-in gone")
        else:
            self.worker.kill()
            self.worker.wait()

    def kill_setup(self) -> None:
        self.worker.kill()
        self.worker.wait()

    def stderr(self) -> str:
        self.kill_worker()
        return self.worker.stderr.read()

    def close(self) -> None:
        for proc in (self.beam, self.worker):
            if proc is not None:
                proc.kill()
                proc.wait()
        for pid_start in (self.interp_id, self.child_id):
            if pid_start is not None and sentinel.look(*pid_start):
                os.kill(pid_start[0], signal.SIGKILL)


@pytest.fixture
def cases():
    made: list[Case] = []
    yield lambda **kw: Case(made, **kw)
    for case in made:
        case.close()


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 :].split()[0] == b"Z"


def test_the_beams_end_ends_the_group_the_interpreter_included(cases):
    case = cases()
    assert case.sentinel is not None
    assert not any(map(gone, [case.worker.pid, case.sentinel, case.child]))
    case.kill_beam()
    # The stand-in sleeps on, as a wedged interpreter would: the sentinel ends it too.
    assert case.worker.wait(timeout=10) == -signal.SIGKILL
    wait_for(lambda: gone(case.child), "the child in the group gone")
    wait_for(lambda: gone(case.sentinel), "the sentinel gone")


def test_the_beams_end_then_the_interpreters_ends_the_group(cases):
    # The order of a kill -9 of the BEAM: the interpreter dies after it.
    case = cases()
    case.kill_beam()
    case.kill_worker()
    wait_for(lambda: gone(case.child), "the child in the group gone")
    wait_for(lambda: gone(case.sentinel), "the sentinel gone")


def test_an_interpreter_gone_while_the_beam_lives_ends_nothing_else(cases):
    # The BEAM stopping a worker: it ends the group itself, after its grace.
    case = cases()
    case.kill_worker()
    wait_for(lambda: gone(case.sentinel), "the sentinel gone")
    time.sleep(2 * sentinel.POLL_SECONDS + 0.5)
    assert not gone(case.child)
    assert sentinel.look(*case.beam_id)


def test_a_group_that_is_not_its_sessions_own_gets_no_sentinel(cases):
    # A worker run by hand from a shell: its group is the shell's job, not its own.
    case = cases(session="group only")
    assert case.sentinel is None
    case.kill_beam()
    time.sleep(2 * sentinel.POLL_SECONDS + 0.5)
    assert case.worker.poll() is None and not gone(case.child)
    note = case.stderr()
    assert f"process group {case.worker.pid} is not its session's own (session " in note


def test_a_beam_not_seen_gets_no_sentinel(cases):
    # Another pid namespace, or a BEAM gone before the worker started.
    done = subprocess.Popen(["true"])
    done.wait()
    case = cases(beam=f"{done.pid}:0")
    assert case.sentinel is None
    assert f"the BEAM's process {done.pid} (started at 0) is not seen here" in case.stderr()


def test_a_beam_that_is_pid_1_needs_no_sentinel():
    # A container's init: its end ends every process of its pid namespace. Said nowhere.
    assert sentinel.start({sentinel.ENV: "1:5"}) is None


@pytest.mark.parametrize("round", range(3))  # the exit and the pipe's end race
def test_a_sentinel_that_does_not_start_is_said_and_the_worker_goes_on(cases, round):
    case = cases(exe="/bin/false")  # an interpreter that exits at once
    assert case.sentinel is None and not gone(case.worker.pid)
    note = case.stderr()
    assert "no sentinel for the BEAM's end: the sentinel (os pid " in note
    assert "/bin/false) exited with status 0x100 before it was armed" in note
    case = cases(exe="/nonexistent/python")
    assert case.sentinel is None
    assert "the sentinel could not be started: [Errno 2]" in case.stderr()


def test_a_sentinel_reaped_elsewhere_before_the_confirmation_is_said(cases):
    case = cases(exe="/bin/false", reaper=True)
    assert case.sentinel is None and not gone(case.worker.pid)
    reaped, note = case.stderr().split("\n", 1)
    assert reaped == "True"  # the stand-in's own wait took it
    assert "/bin/false) exited before it was armed (reaped elsewhere)" in note


def test_spawn_work_then_confirm_gives_a_sentinel_that_watches(cases):
    case = cases(reaper=True)  # the real interpreter: armed, not reaped
    assert case.sentinel is not None
    case.kill_beam()
    wait_for(lambda: gone(case.child), "the child in the group gone")


def test_erl_child_setup_gone_with_the_interpreter_is_the_beams_end(cases):
    # The moment after the BEAM's files closed: erl_child_setup and the interpreter
    # have gone, the BEAM's own process does not read as exited yet.
    case = cases(via_setup=True)
    assert case.sentinel is not None
    case.kill_setup()
    case.kill_worker()
    wait_for(lambda: gone(case.child), "the child in the group gone")
    assert sentinel.look(*case.beam_id)


def test_erl_child_setup_alive_the_interpreters_end_ends_nothing_else(cases):
    case = cases(via_setup=True)
    case.kill_worker()
    wait_for(lambda: gone(case.sentinel), "the sentinel gone")
    time.sleep(2 * sentinel.POLL_SECONDS + 0.5)
    assert not gone(case.child)


def test_a_worker_with_its_stdio_closed_gets_a_sentinel_holding_none_of_it(cases):
    # Its pipe's fds are 0 and 1 then, which the sentinel's /dev/null takes.
    case = cases(closed_stdio=True)
    assert case.sentinel is not None
    fds = Path(f"/proc/{case.sentinel}/fd")
    assert {os.readlink(fds / n) for n in os.listdir(fds)} == {os.devnull}
    case.kill_beam()
    wait_for(lambda: gone(case.child), "the child in the group gone")


def test_nothing_beside_the_sentinel_shadows_a_standard_module():
    # Python 3.10's -I still puts the script's folder first on sys.path (3.11's does
    # not): a worker module named like a standard one would be imported instead.
    names = {p.stem for p in SENTINEL.parent.glob("*.py")} | {
        p.name for p in SENTINEL.parent.iterdir() if p.is_dir()
    }
    assert not names & set(sys.stdlib_module_names)


def test_the_request_leaves_the_environment(cases):
    # Processes the worker starts must not start sentinels of their own for it.
    assert cases().env_seen == "None"


def test_the_sentinel_holds_none_of_the_workers_files(cases):
    case = cases()
    fds = Path(f"/proc/{case.sentinel}/fd")
    assert sorted(int(n) for n in os.listdir(fds)) == [0, 1, 2]
    assert {os.readlink(fds / n) for n in os.listdir(fds)} == {os.devnull}


def test_no_request_no_sentinel():
    env: dict[str, str] = {}
    assert sentinel.start(env) is None


@pytest.mark.parametrize(
    "value",
    ["", "abc", "12", "12:", ":5", "0:5", "-3:5", "12:-5", "12:5:6", " 12:5",
     "12:5\n", "\uff11\uff12:5", "12:\u0665"],
)
def test_a_malformed_request_is_refused_naming_it(value):
    env = {sentinel.ENV: value}
    with pytest.raises(SystemExit) as info:
        sentinel.start(env)
    assert repr(value) in str(info.value)
    assert sentinel.ENV in str(info.value)


def test_parse_reads_pid_and_start():
    assert sentinel.parse("4242:987654") == (4242, 987654)


def test_look_knows_a_process_by_its_start_time_and_a_zombie_as_gone():
    me = os.getpid()
    assert sentinel.look(me, start_time(me)) is True
    assert sentinel.look(me, start_time(me) + 1) is False
    child = subprocess.Popen(["sleep", "300"])
    began = start_time(child.pid)
    child.kill()
    wait_for(lambda: gone(child.pid), "the child a zombie")
    assert sentinel.look(child.pid, began) is False  # a zombie, not reaped yet
    child.wait()
    assert sentinel.look(child.pid, began) is False


def test_a_look_that_cannot_read_proc_tells_nothing():
    # No file descriptor left (EMFILE): not the BEAM's end, which would kill the group.
    code = """
import importlib.util, os, resource, sys
spec = importlib.util.spec_from_file_location("sentinel", sys.argv[1])
sentinel = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sentinel)
pid, start = int(sys.argv[2]), int(sys.argv[3])
print(sentinel.look(pid, start))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
print(sentinel.look(pid, start))
"""
    me = os.getpid()
    out = subprocess.run(
        [sys.executable, "-c", code, str(SENTINEL), str(me), str(start_time(me))],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.split() == ["True", "None"]


def test_a_process_proc_hides_is_not_taken_for_gone(monkeypatch):
    # /proc mounted with hidepid, the BEAM another user's: its entry reads as absent
    # while the process is there. Injected: every /proc read of the module fails so.
    def hidden(path, *args, **kwargs):
        raise FileNotFoundError(errno.ENOENT, "hidden", path)

    monkeypatch.setattr(sentinel, "open", hidden, raising=False)
    assert sentinel.look(os.getpid(), 0) is None
    done = subprocess.Popen(["true"])
    done.wait()
    assert sentinel.look(done.pid, 0) is False
