"""Output and logging from inside a worker, for the runtime tests of where it goes
(test/runtime/worker_output_test.exs): each function writes in one of the ways user code
does, and returns this process's pid (which worker wrote)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


def say(text: str) -> int:
    """``print``, to sys.stdout."""
    print(text)
    return os.getpid()


def complain(text: str) -> int:
    """``sys.stderr.write`` of one line."""
    sys.stderr.write(text + "\n")
    return os.getpid()


def raw(fd: int, text: str) -> int:
    """``os.write`` straight to fd 1 or 2, past Python's streams (as C code writes)."""
    if fd not in (1, 2):
        raise ValueError(f"fd must be 1 or 2, got {fd!r}")
    os.write(fd, text.encode())
    return os.getpid()


def child(text: str) -> int:
    """A child process that inherits fds 1 and 2 writes a line to each."""
    subprocess.run(
        [sys.executable, "-c", "import sys; print(sys.argv[1]); print(sys.argv[1] + ' (err)', "
         "file=sys.stderr)", text],
        check=True,
    )
    return os.getpid()


def flood(lines: int, width: int = 100) -> int:
    """``lines`` lines of ``width`` characters to stdout, as fast as Python writes."""
    if lines < 0 or width < 1:
        raise ValueError(f"lines must be >= 0 and width >= 1, got {lines!r}, {width!r}")
    row = "x" * width + "\n"
    out = sys.stdout
    for _ in range(lines):
        out.write(row)
    out.flush()
    return os.getpid()


def die_with(text: str, status: int = 3) -> None:
    """Writes ``text`` (no newline at its end) to fd 2, then the process ends at once."""
    os.write(2, text.encode())
    os._exit(status)


def log(name: str, level: str, message: str, own_level: str | None = None) -> int:
    """A record of ``level`` on the logger ``name`` (set to ``own_level`` first, as a
    library sets its own logger's level)."""
    for value in (level, own_level or "debug"):
        if value not in _LEVELS:
            raise ValueError(f"level must be one of {sorted(_LEVELS)}, got {value!r}")
    logger = logging.getLogger(name)
    if own_level is not None:
        logger.setLevel(_LEVELS[own_level])
    logger.log(_LEVELS[level], message)
    return os.getpid()
