"""A plain call that runs until the test lets it end, for the runtime tests of the Elixir
side that need a worker busy for as long as they look at it (test/runtime/
session_busy_test.exs): a ``diag.sleep`` of a fixed length would race the machine's speed.
"""

from __future__ import annotations

import os
import time


def wait_for(path: str, limit: float = 60.0) -> int:
    """Block until the file ``path`` exists (looked for every 5 ms), then return this
    process's pid (which worker ran the call). Raise ``TimeoutError`` after ``limit``
    seconds, so a test that fails half-way does not leave its worker busy for good."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"path must be a non-empty str, got {path!r}")
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
        raise ValueError(f"limit must be a positive number of seconds, got {limit!r}")
    end = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {limit} s")
        time.sleep(0.005)
    return os.getpid()
