"""Code for the cancel tests that a worker runs (allow-listed by the tests that use it,
which put this directory on the worker's ``PYTHONPATH``: python/tests/bridge/test_worker_cancel.py,
test_worker_interrupt_window.py, and the ExUnit tests test/runtime/cancel_test.exs and
pool_failure_test.exs): code that logs without pause, so that a cancel's interruption
lands while a ``log`` frame is being written, and code stuck in C, which a cancel cannot
interrupt. Not a public module: ``stuck`` makes a call uninterruptible, which no caller
of the default allow-list may do."""

from __future__ import annotations

import logging
import signal
import time

from vllm_bridge.bridge.worker.interrupt import INTERRUPT_SIGNAL

_log = logging.getLogger("cancel_support")


def stuck(seconds: float) -> float:
    """Sleep ``seconds`` as code stuck in C would: the worker's interrupt signal is
    blocked on this thread meanwhile (``signal.pthread_sigmask``; the mask is restored
    after), so a cancel cannot interrupt it before it returns; then it is interrupted at
    once. Returns ``seconds``. A stand-in for a call that a cancel does not stop within
    ``cancel_grace``."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"seconds must be a non-negative number, got {seconds!r}")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {INTERRUPT_SIGNAL})
    try:
        time.sleep(seconds)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return seconds


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
