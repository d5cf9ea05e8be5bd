"""End the worker's process group once the BEAM that started it is gone.

A BEAM that stops a worker ends every process of the worker's group with it
(``VllmBridge.Worker.OsProcess``). A BEAM killed with ``kill -9`` ends nothing: its
workers die with it (:mod:`.lifeline`), but a process the worker's Python code started
in the group (a ``subprocess``, a ``multiprocessing`` child, a rank that holds a GPU)
would live on, with nobody left to end it.

So the worker starts a *sentinel*: a small interpreter of its own (this file run as a
script, ``python -I -S``, with nothing but the standard library: about 11 MB), which
stays in the worker's group, holds none of its files, and sleeps. It wakes when the
interpreter that started it exits (``PR_SET_PDEATHSIG``) and once every
:data:`POLL_SECONDS`. On each wake:

* the BEAM is gone (its pid no longer names the process of the start time it was
  given, or names one whose main thread has exited, which ERTS's never does while the
  BEAM runs): it kills the group with SIGKILL, itself included. This also ends an
  interpreter that is still there, one wedged in a C call say. A look that fails for
  another reason (``/proc`` unreadable for a moment: no file descriptor or memory left)
  is not taken for the BEAM's end: the next look decides. The interpreter's parent,
  when it is the BEAM's ``erl_child_setup``, gone with the interpreter is the BEAM's
  end too (it goes once the BEAM's files are closed, a moment before the BEAM's
  process may read as exited);
* the interpreter is gone and the BEAM is not: the BEAM is stopping the worker, and
  ends the group itself after its grace (``shutdown_grace``); the sentinel just exits.

The BEAM asks for one through :data:`ENV` (``PID:START``, its OS pid and start time in
clock ticks since boot, ``/proc/<pid>/stat`` field 22). None is started:

* when the group is not its session's own group: an Erlang port's process leads a
  session and a group of its own, so the group is the worker's and no one else's. A
  worker started by hand in a shell, whose group is the shell's job, gets none;
* when the BEAM is pid 1 (a container's init): when it dies, the kernel kills every
  process of its pid namespace;
* when the BEAM's process is not seen (a wrapper that runs the interpreter in another
  pid namespace), or the sentinel could not be started: the worker runs without one,
  and says so on stderr.

A process that left the group (``start_new_session=True``) is left alone, as the BEAM
leaves it alone.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import select
import signal
import sys
import time

#: The environment variable the BEAM names itself in (``PID:START``); removed from the
#: environment as it is read, so that processes the worker starts do not inherit it.
ENV = "VLLM_BRIDGE_BEAM"

#: Seconds between two looks at the BEAM while the interpreter lives.
POLL_SECONDS = 1.0
#: Seconds :meth:`Spawned.confirm` waits for the sentinel to say it is armed (it takes
#: about 40 ms: an interpreter's start).
READY_SECONDS = 10.0
#: The name of the BEAM's helper that forks its ports' processes (``/proc/<pid>/comm``).
ERL_CHILD_SETUP = b"erl_child_setup"

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
#: The sentinel's name in ``ps -o comm`` and ``top`` (at most 15 bytes).
NAME = b"vllm-bridge-snt"


def parse(value: str) -> tuple[int, int]:
    """``"PID:START"`` as ``(pid, start)``; ``ValueError`` naming the value otherwise."""
    pid, sep, start = value.partition(":")
    if sep and pid.isdigit() and start.isdigit() and pid.isascii() and start.isascii():
        if int(pid) > 0:
            return int(pid), int(start)
    raise ValueError(
        f"{ENV} must be PID:START (the BEAM's os pid, above 0, and its start time in "
        f"clock ticks, decimal digits), got {value!r}"
    )


def look(pid: int, start: int) -> bool | None:
    """Whether ``pid`` is still the process that started at ``start`` and its main
    thread has not exited (state neither ``Z`` nor ``X``); None when that cannot be
    told: ``/proc`` could not be read for another reason than the process's absence,
    or read as nothing a kernel writes, or hides a process that is there (``hidepid``,
    another user's process)."""
    try:
        state, began = _stat(pid)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ESRCH):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return None
        return None
    except (IndexError, ValueError):
        return None
    return began == start and state not in (b"Z", b"X")


def _stat(pid: int) -> tuple[bytes, int]:
    # The state (field 3) and start time (field 22) of /proc/<pid>/stat; the fields
    # follow the command's name in parentheses, which may itself hold ") ".
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[0], int(fields[19])


def start(environ: os._Environ[str] | dict[str, str] = os.environ) -> int | None:
    """:func:`spawn`, then :meth:`Spawned.confirm`: the sentinel's pid once it is armed,
    or None when none runs."""
    spawned = spawn(environ)
    return None if spawned is None else spawned.confirm()


def spawn(environ: os._Environ[str] | dict[str, str] = os.environ) -> Spawned | None:
    """Starts the sentinel when :data:`ENV` asks for one; None when none is started
    (see the module; said on stderr, but when nothing asked for one, the BEAM is pid 1,
    or this is not Linux). Call it from the main thread. The sentinel runs for sure once
    :meth:`Spawned.confirm` says so: the worker confirms just before its hello, so
    that the sentinel's start (about 40 ms) overlaps its own.

    Raises ``SystemExit`` naming the value when :data:`ENV` is malformed.
    """
    value = environ.pop(ENV, None)
    if value is None:
        return None
    try:
        beam = parse(value)
    except ValueError as exc:
        raise SystemExit(f"vllm_bridge.bridge.worker: {exc}") from None
    if beam[0] == 1 or not sys.platform.startswith("linux"):
        return None
    group, session = os.getpgid(0), os.getsid(0)
    # 0: a session led from outside this pid namespace, whose group is not ours either.
    if group != session or group <= 0:
        _note(f"process group {group} is not its session's own (session {session})")
        return None
    if not look(*beam):
        # Another pid namespace, or a BEAM already gone: its pid says nothing here.
        _note(f"the BEAM's process {beam[0]} (started at {beam[1]}) is not seen here")
        return None
    try:
        return _spawn(beam, _setup())
    except (OSError, ValueError) as exc:  # no process to be had (pids.max), no interpreter
        _note(f"the sentinel could not be started: {exc}")
        return None


def _setup() -> tuple[int, int] | None:
    # This interpreter's parent, when it is the BEAM's erl_child_setup (the launcher
    # execs the interpreter; a `python:` wrapper may not): it lives as long as the BEAM
    # and ends once the BEAM's files are closed, which may be a moment before the
    # BEAM's own process reads as exited. Its end with the interpreter's is the BEAM's.
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/comm", "rb") as f:
            if f.read().rstrip(b"\n") != ERL_CHILD_SETUP:
                return None
        return ppid, _stat(ppid)[1]
    except (OSError, IndexError, ValueError):
        return None


def _spawn(beam: tuple[int, int], setup: tuple[int, int] | None) -> Spawned:
    # A process of its own (posix_spawn: no copy of the worker's memory, no Popen left
    # to warn at exit), not a fork that stays: a forked copy of the worker would keep
    # every page the worker writes later (149 MB of 227 measured, with torch loaded).
    # It gets none of the worker's files: holding the port's pipes would keep the BEAM
    # from seeing the worker's end (EOF), and an output FIFO its reader from finishing;
    # only the write end of `ready`, where it says it is armed, on its fd 3. That end
    # stays close-on-exec here, so that no other process started meanwhile holds it,
    # and is put on fd 3 by the spawn's last action (a dup2 to another number clears
    # close-on-exec); it is moved to fd 10 or above first, so it is never 0-2 (taken
    # by /dev/null: the worker's stdio may be closed) nor 3 itself.
    ready, low = os.pipe()
    armed = -1
    try:
        armed = fcntl.fcntl(low, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(low)
        low = -1
        actions = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
            (os.POSIX_SPAWN_DUP2, 1, 2),
            *[(os.POSIX_SPAWN_CLOSE, fd) for fd in _inheritable() if fd > 2],
            (os.POSIX_SPAWN_DUP2, armed, 3),
        ]
        script = os.path.abspath(__file__)
        argv = [sys.executable, "-I", "-S", script, *map(str, beam), *map(str, setup or (0, 0))]
        argv += [str(os.getpid()), "3"]
        pid = os.posix_spawn(
            sys.executable, argv, os.environ, file_actions=actions,
            setsigmask={signal.SIGUSR1},
        )
    except BaseException:
        os.close(ready)
        raise
    finally:
        for fd in (low, armed):
            if fd >= 0:
                os.close(fd)
    return Spawned(pid, ready)


class Spawned:
    """A sentinel started, not yet known to be armed."""

    def __init__(self, pid: int, ready: int) -> None:
        self.pid = pid
        self._ready = ready  # the read end of its pipe (close-on-exec)

    def confirm(self) -> int | None:
        """Waits (up to :data:`READY_SECONDS`) for the sentinel to say it is armed; its
        pid, or None, having said why on stderr and ended it when it is still there."""
        try:
            got, ended = _read(self._ready, 2)
        finally:
            os.close(self._ready)
        if got == b"+" and ended:  # armed, and its end closed: it holds no file of ours
            return self.pid
        # Not armed: none runs. Reaped elsewhere already (SIGCHLD ignored, or code that
        # waits for any child), it has exited.
        try:
            how = self._end(ended)
        except (ChildProcessError, ProcessLookupError):
            how = "exited before it was armed (reaped elsewhere)"
        _note(f"the sentinel (os pid {self.pid}, {sys.executable}) {how}")
        return None

    def _end(self, ended: bool) -> str:
        # It exited by itself (it closed its end a moment before it can be reaped:
        # waited for), or it is ended here. What became of it, in words.
        if ended:
            for _ in range(100):
                done, status = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    return f"exited with status {status:#x} before it was armed"
                time.sleep(0.01)
            how = "closed its pipe without saying it was armed"
        else:
            how = f"did not say it was armed within {READY_SECONDS} s"
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        return how + "; ended"


def _read(fd: int, n: int) -> tuple[bytes, bool]:
    # Up to n bytes from fd within READY_SECONDS in all, and whether EOF came.
    got = b""
    end = time.monotonic() + READY_SECONDS
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    while len(got) < n:
        left = end - time.monotonic()
        if left <= 0 or not poll.poll(left * 1000):
            return got, False
        chunk = os.read(fd, n - len(got))
        if not chunk:
            return got, True
        got += chunk
    return got, False


def _inheritable() -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.get_inheritable(int(name)):
                fds.append(int(name))
        except OSError:
            pass  # the listing's own fd, closed by now
    return fds


def _note(why: str) -> None:
    line = f"vllm_bridge.bridge.worker {os.getpid()}: no sentinel for the BEAM's end: {why}\n"
    try:  # fd 2 itself: sys.stderr may be None (a worker started with fd 2 closed)
        os.write(2, line.encode("utf-8", "replace"))
    except OSError:
        pass


def watch(
    beam: tuple[int, int],
    parent: int,
    setup: tuple[int, int] | None = None,
    armed: int | None = None,
) -> None:
    """The sentinel's loop (see the module): returns when ``parent`` has exited while
    the BEAM lives; kills its own group, itself included, once the BEAM is gone, or
    ``setup`` (the parent's parent, the BEAM's erl_child_setup) is gone with the
    parent. Writes one byte to ``armed`` (then closes it) once it watches."""
    # Blocked before it is armed: SIGUSR1's default action would end the sentinel.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGUSR1), 0, 0, 0)
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(NAME), 0, 0, 0)
    if armed is not None:
        try:
            os.write(armed, b"+")
        except OSError:
            pass  # confirm() gave up waiting: it ends this process
        os.close(armed)
    # A parent that exited before the signal was armed is seen below, at once. When the
    # BEAM dies, its workers end after it: erl_child_setup, their parent, goes once the
    # BEAM's files are closed, after every thread of the BEAM has exited but maybe a
    # moment before its process reads as exited; then the interpreter (its
    # PR_SET_PDEATHSIG). So the BEAM's end is looked for first, and erl_child_setup's
    # is taken for it once the interpreter is gone.
    while True:
        orphaned = os.getppid() != parent
        gone = look(*beam) is False or (
            orphaned and setup is not None and look(*setup) is False
        )
        if gone:
            os.killpg(0, signal.SIGKILL)
        if orphaned:
            return
        signal.sigtimedwait({signal.SIGUSR1}, POLL_SECONDS)


if __name__ == "__main__":
    # python -I -S sentinel.py BEAM_PID BEAM_START SETUP_PID SETUP_START PARENT ARMED_FD,
    # as start() runs it (SETUP 0 0: none known).
    _beam_pid, _beam_start, _setup_pid, _setup_start, _parent, _armed = (
        int(a) for a in sys.argv[1:]
    )
    watch(
        (_beam_pid, _beam_start),
        _parent,
        (_setup_pid, _setup_start) if _setup_pid > 0 else None,
        _armed,
    )
