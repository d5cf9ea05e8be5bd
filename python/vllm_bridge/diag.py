"""Diagnostics callable over the bridge: identity of the worker and tiny test functions.

These exist so that the plumbing (framing, codec, dispatch, timeouts) can be exercised
without the forward-context system.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def info() -> dict[str, Any]:
    """Describe this worker process: OS pid, Python and torch versions, device."""
    import torch

    from vllm_bridge import PROTOCOL_VERSION

    return {
        "protocol": PROTOCOL_VERSION,
        "pid": os.getpid(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": default_device(),
    }


def default_device() -> str:
    """The device this worker computes on: ``cuda:N`` when CUDA is usable, else ``cpu``."""
    import torch

    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def echo(value: Any) -> Any:
    """Return ``value`` unchanged (a round trip through both codecs)."""
    return value


def add(a: int | float, b: int | float) -> int | float:
    """Return ``a + b``."""
    return a + b


def sleep(seconds: float) -> float:
    """Sleep for ``seconds`` and return them; a stand-in for a long forward pass."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
        raise ValueError(f"seconds must be a non-negative number, got {seconds!r}")
    time.sleep(seconds)
    return seconds
