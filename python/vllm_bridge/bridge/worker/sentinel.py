"""End the worker's process group once the BEAM that started it is gone.

A BEAM that stops a worker ends every process of the worker's group with it
(``VllmBridge.Worker.OsProcess``). A BEAM killed with ``kill -9`` ends nothing: its
workers die with it (:mod:`.lifeline`), but a process the worker's Python code started
in the group (a ``subprocess``, a ``multiprocessing`` child, a rank that holds a GPU)
would live on, with nobody left to end it.

So the worker starts a *sentinel*: a small interpreter of its own (this file run as a
script, ``python -I -S``, with nothing but the standard library: about 10 MB), which
stays in the worker's group, holds none of its files, and sleeps. It wakes when the
interpreter that started it exits (``PR_SET_PDEATHSIG``) and once every
:data:`POLL_SECONDS`. On each wake:

* the BEAM is gone (its pid no longer names the process of the start time it was
  given, or names a zombie): it kills the group with SIGKILL, itself included. This
  also ends an interpreter that is still there, one wedged in a C call say;
* the interpreter is gone and the BEAM is not: the BEAM is stopping the worker, and
  ends the group itself after its grace (``shutdown_grace``); the sentinel just exits.

The BEAM asks for one through :data:`ENV` (``PID:START``, its OS pid and start time in
clock ticks since boot, ``/proc/<pid>/stat`` field 22). The group is killed only when it
is its session's own group: an Erlang port's process leads a session and a group of its
own, so the group is the worker's and no one else's. A worker started by hand in a
shell, whose group is the shell's job, never gets a sentinel. A process that left the
group (``start_new_session=True``) is left alone, as the BEAM leaves it alone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

#: The environment variable the BEAM names itself in (``PID:START``); removed from the
#: environment as it is read, so that processes the worker starts do not inherit it.
ENV = "VLLM_BRIDGE_BEAM"

#: Seconds between two looks at the BEAM while the interpreter lives.
POLL_SECONDS = 1.0

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
#: The sentinel's name in ``ps -o comm`` and ``top`` (at most 15 bytes).
NAME = b"vllm-bridge-snt"


def parse(value: str) -> tuple[int, int]:
    """``"PID:START"`` as ``(pid, start)``; ``ValueError`` naming the value otherwise."""
    pid, sep, start = value.partition(":")
    if sep and pid.isdigit() and start.isdigit() and pid.isascii() and start.isascii():
        if int(pid) > 1:
            return int(pid), int(start)
    raise ValueError(
        f"{ENV} must be PID:START (the BEAM's os pid, above 1, and its start time in "
        f"clock ticks, decimal digits), got {value!r}"
    )


def alive(pid: int, start: int) -> bool:
    """Whether ``pid`` is still the process that started at ``start``, not a zombie.

    A zombie is one whose every thread has exited: the state in ``/proc/<pid>/stat``
    is the main thread's, ``Z`` while another thread may still be exiting.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        state, threads, began = fields[0], int(fields[17]), int(fields[19])
    except (IndexError, ValueError):
        return False
    return began == start and not (state == b"Z" and threads <= 1)


def start(environ: os._Environ[str] | dict[str, str] = os.environ) -> int | None:
    """Forks the sentinel when :data:`ENV` asks for one; its pid, or None (no request,
    not Linux, a group that is not its session's own, or a BEAM not seen: each but the
    first said on stderr). Call it before any thread of the worker's starts.

    Raises ``SystemExit`` naming the value when :data:`ENV` is malformed.
    """
    value = environ.pop(ENV, None)
    if value is None:
        return None
    try:
        beam = parse(value)
    except ValueError as exc:
        raise SystemExit(f"vllm_bridge.bridge.worker: {exc}") from None
    if not sys.platform.startswith("linux"):
        return None
    group, session = os.getpgid(0), os.getsid(0)
    if group != session:
        _note(f"process group {group} is not its session's own (session {session})")
        return None
    if not alive(*beam):
        # Another pid namespace (a wrapper that runs the interpreter in a container),
        # or a BEAM already gone: either way its pid says nothing here.
        _note(f"the BEAM's process {beam[0]} (started at {beam[1]}) is not seen here")
        return None
    # Not a fork that stays: a forked copy of the worker would keep every page of the
    # worker's that the worker writes later (150 MB and more with torch loaded).
    # close_fds: holding the port's pipes would keep the BEAM from seeing the worker's
    # end (EOF), and an output FIFO its reader from finishing.
    args = [str(beam[0]), str(beam[1]), str(os.getpid())]
    _running.append(
        subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
    )
    return _running[-1].pid


#: The sentinel's handle, kept for the life of the worker (it ends after the worker).
_running: list[subprocess.Popen[bytes]] = []


def _note(why: str) -> None:
    sys.stderr.write(
        f"vllm_bridge.bridge.worker {os.getpid()}: no sentinel for the BEAM's end: {why}\n"
    )


def watch(beam: tuple[int, int], parent: int) -> None:
    """The sentinel's loop (see the module): returns when ``parent`` has exited while
    the BEAM lives; kills its own group, itself included, once the BEAM is gone."""
    # Blocked before it is armed: SIGUSR1's default action would end the sentinel.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGUSR1), 0, 0, 0)
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(NAME), 0, 0, 0)
    # A parent that exited before the signal was armed is seen below, at once. On each
    # wake the BEAM's end is looked at first: when the BEAM dies, its workers end after
    # it (their parent, erl_child_setup, goes once the BEAM's files are closed, which is
    # after its every thread has exited), so by the time the interpreter is seen gone,
    # so is the BEAM.
    while True:
        if not alive(*beam):
            os.killpg(0, signal.SIGKILL)
        if os.getppid() != parent:
            return
        signal.sigtimedwait({signal.SIGUSR1}, POLL_SECONDS)


if __name__ == "__main__":
    # python -I -S sentinel.py BEAM_PID BEAM_START PARENT_PID, as start() runs it.
    _pid, _start, _parent = (int(a) for a in sys.argv[1:])
    watch((_pid, _start), _parent)
