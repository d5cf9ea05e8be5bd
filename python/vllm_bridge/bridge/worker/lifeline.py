"""Exit when the parent process is gone, even while a long call runs.

Two mechanisms, because neither covers every case alone:

* a daemon thread polls ``os.getppid()``; when the parent dies the worker is re-parented
  and the value changes. It needs the GIL, which a long call releases in any blocking or
  torch call and Python hands over every few milliseconds otherwise.
* on Linux, ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` makes the kernel kill the worker the
  moment its parent dies, whatever the worker is doing. The kernel sends it when the
  parent *thread* that forked the worker ends, so it is only set when the parent has a
  single thread (an Erlang VM starts ports from its single-threaded ``erl_child_setup``);
  a worker started from a thread of a busy process relies on the poll alone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1

#: Seconds between two looks at the parent pid.
POLL_SECONDS = 0.2


def _parent_thread_count(ppid: int) -> int | None:
    try:
        with open(f"/proc/{ppid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _set_pdeathsig() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _gone(reason: str) -> None:
    sys.stderr.write(f"vllm_bridge.bridge.worker {os.getpid()}: {reason}; exiting\n")
    sys.stderr.flush()
    os._exit(0)


def watch_parent(poll_seconds: float = POLL_SECONDS) -> threading.Thread:
    """Arrange for this process to exit when its parent does; returns the poll thread."""
    ppid = os.getppid()
    if _parent_thread_count(ppid) == 1:
        _set_pdeathsig()
    if os.getppid() != ppid:  # the parent died before the signal was armed
        _gone(f"parent process {ppid} is gone")

    def poll() -> None:
        stop = threading.Event()
        while not stop.wait(poll_seconds):
            if os.getppid() != ppid:
                _gone(f"parent process {ppid} is gone")

    thread = threading.Thread(target=poll, name="vllm-bridge-lifeline", daemon=True)
    thread.start()
    return thread
