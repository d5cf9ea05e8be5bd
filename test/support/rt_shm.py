"""A call that holds a tensor until the test lets it end, for test/runtime/shm_test.exs:
the worker has read the tensor's slot and is still running when the test kills it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from rt_gate import wait_for


def hold(tensor: torch.Tensor, started: str, gate: str) -> torch.Tensor:
    """Create the file ``started``, wait until the file ``gate`` exists, return ``tensor``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    Path(started).touch()
    wait_for(gate)
    return tensor


def chunks(n: int, numel: int) -> Iterator[torch.Tensor]:
    """Yields ``n`` float32 tensors of ``numel`` elements, the i-th all ``i + 1.0`` (a
    stream whose chunks are large enough for result slots, each telling which it is)."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int of at least 0, got {n!r}")
    if not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel must be an int of at least 1, got {numel!r}")
    for i in range(n):
        yield torch.full((numel,), float(i + 1), dtype=torch.float32)


def filled(numel: int, value: float) -> torch.Tensor:
    """A float32 tensor of ``numel`` elements, all ``value``: a small request whose reply
    is large enough for a result slot, telling whose it is."""
    if not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel must be an int of at least 1, got {numel!r}")
    return torch.full((numel,), float(value), dtype=torch.float32)
