"""Batch-size tracking: forward-pass time per batch size, logged as medians.

On when the logging interval is >= 0: read from ``VLLM_LOG_BATCHSIZE_INTERVAL`` (seconds,
default -1 = off) at import, or set with :func:`configure_batchsize_tracking`. Each forward
pass run under ``set_forward_context`` with attention metadata records its wall time in
milliseconds, after waiting for the device (``current_platform.synchronize``), under its
``num_tokens``. At most once per interval the stats are logged (logger
``vllm_bridge.forward_context``) as ``(batchsize, count, median_ms)`` sorted by count,
skipping sizes seen only once (those are usually CUDA-graph capture or profiling runs).

The state below is also readable as attributes of :mod:`vllm_bridge.forward_context`
(``track_batchsize``, ``batchsize_logging_interval``, ``batchsize_forward_time``,
``forward_start_time``, ``last_logging_time``), as in vLLM.
"""

import logging
import os
import statistics
import threading
import time
from collections import defaultdict

from vllm_bridge._checks import check_int
from vllm_bridge.platforms import current_platform

__all__ = [
    "configure_batchsize_tracking",
    "get_batchsize_stats",
    "reset_batchsize_stats",
]

logger = logging.getLogger("vllm_bridge.forward_context")


def _interval_from_env() -> float:
    raw = os.environ.get("VLLM_LOG_BATCHSIZE_INTERVAL", "-1")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"VLLM_LOG_BATCHSIZE_INTERVAL must be a number, got {raw!r}") from None


#: Seconds between stats log lines; negative means tracking is off.
batchsize_logging_interval: float = _interval_from_env()
#: Whether forward passes are being timed.
track_batchsize: bool = batchsize_logging_interval >= 0
#: Forward times in milliseconds, by batch size (``num_tokens``; ``None`` when not given).
batchsize_forward_time: defaultdict[int | None, list[float]] = defaultdict(list)
#: ``time.perf_counter()`` at the start of the latest tracked forward pass.
forward_start_time: float = 0.0
#: ``time.perf_counter()`` when the stats were last logged.
last_logging_time: float = 0.0

_lock = threading.Lock()


def configure_batchsize_tracking(interval_s: float) -> None:
    """Turn tracking on (``interval_s >= 0``, seconds between log lines) or off (< 0)."""
    global batchsize_logging_interval, track_batchsize
    if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)):
        raise TypeError(f"interval_s must be a number of seconds, got {interval_s!r}")
    if interval_s != interval_s:
        raise ValueError(f"interval_s must be a number of seconds, got {interval_s!r}")
    with _lock:
        batchsize_logging_interval = float(interval_s)
        track_batchsize = batchsize_logging_interval >= 0


def reset_batchsize_stats() -> None:
    """Forget every recorded forward time and the time of the last log line."""
    global last_logging_time
    with _lock:
        batchsize_forward_time.clear()
        last_logging_time = 0.0


def _stats_locked(min_count: int) -> list[tuple[int | None, int, float]]:
    stats = [
        (size, len(times), round(statistics.median(times), 2))
        for size, times in batchsize_forward_time.items()
        if len(times) >= min_count
    ]
    # Most frequent first; ties by batch size, None last.
    stats.sort(key=lambda s: (-s[1], s[0] is None, s[0] or 0))
    return stats


def get_batchsize_stats(min_count: int = 2) -> list[tuple[int | None, int, float]]:
    """The recorded stats: ``(batchsize, count, median_time_ms)`` sorted by count, descending.

    Args:
        min_count: Leave out batch sizes recorded fewer times than this (the log leaves out
            sizes seen once).
    """
    check_int("min_count", min_count, minimum=1)
    with _lock:
        return _stats_locked(min_count)


def begin() -> float:
    """Start timing a forward pass; returns its start time (also kept in forward_start_time)."""
    global forward_start_time
    start = time.perf_counter()
    forward_start_time = start
    return start


def end(batchsize: int | None, start: float) -> None:
    """Finish timing the forward pass begun at ``start``: sync, record, maybe log."""
    global last_logging_time
    synchronize = current_platform.synchronize
    if synchronize is not None:
        synchronize()
    now = time.perf_counter()
    with _lock:
        batchsize_forward_time[batchsize].append((now - start) * 1000.0)
        if now - last_logging_time <= batchsize_logging_interval:
            return
        last_logging_time = now
        stats = _stats_locked(2)
    if stats:
        logger.info("Batchsize forward time stats (batchsize, count, median_time(ms)): %s", stats)
