"""Code for the cancel tests that a worker runs (allow-listed by test_worker_cancel.py,
which puts this directory on the worker's ``PYTHONPATH``): code that logs without pause,
so that a cancel's interruption lands while a ``log`` frame is being written."""

from __future__ import annotations

import logging
import time

_log = logging.getLogger("cancel_support")


def log_loop(seconds: float, size: int) -> int:
    """Log warnings of ``size`` characters without pause for ``seconds``; the count."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    message = "x" * size
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        _log.warning("%d %s", n, message)
        n += 1
    return n
