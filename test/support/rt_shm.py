"""A call that holds a tensor until the test lets it end, for test/runtime/shm_test.exs:
the worker has read the tensor's slot and is still running when the test kills it."""

from __future__ import annotations

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
