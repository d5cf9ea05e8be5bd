"""Figures a worker reports in its ``pong`` (VllmBridge.Pool.status/2 reads them)."""

from __future__ import annotations

import sys


def cuda_memory() -> dict[str, int] | None:
    """Bytes of CUDA memory this process's caching allocator has allocated and reserved
    on its current device, for ``pong``; ``None`` when CUDA was never initialised here (a
    status must not initialise it, which takes seconds and memory)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        return {
            "allocated": int(torch.cuda.memory_allocated()),
            "reserved": int(torch.cuda.memory_reserved()),
        }
    except Exception:  # a broken device must not cost the pong
        return None
