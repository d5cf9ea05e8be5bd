"""Processes a worker's Python code starts, for the runtime tests of what outlives a
worker (test/runtime/worker_leftovers_test.exs)."""

from __future__ import annotations

import subprocess


def sleeper(seconds: int, own_session: bool = False) -> int:
    """Starts ``sleep seconds`` in the background (stdio on /dev/null, not waited for):
    in this process's group, or in a session of its own. Returns its pid."""
    if type(seconds) is not int or seconds < 1:
        raise ValueError(f"seconds must be an int >= 1, got {seconds!r}")
    child = subprocess.Popen(
        ["sleep", str(seconds)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=own_session,
    )
    return child.pid
