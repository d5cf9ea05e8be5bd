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


def get_loggers(seconds: float) -> int:
    """Ask logging for loggers without pause for ``seconds`` (each ``getLogger`` takes
    and releases logging's module lock); the count."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        logging.getLogger(f"cancel_support.{n % 64}")
        n += 1
    return n


def logging_lock_free() -> bool:
    """Whether logging's module lock can be taken (within 5 s), as the worker's own log
    calls must."""
    lock = logging._lock  # type: ignore[attr-defined]
    if lock.acquire(timeout=5):
        lock.release()
        return True
    return False
