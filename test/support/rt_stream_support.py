"""Generators and calls for the runtime tests of the Elixir side (test/runtime/: the
stream, context-manager, loose-reference and worker-down tests), beyond what
``vllm_bridge.bridge.diag`` has: a generator that fails part-way, objects that travel only as
references (one of them late, whatever its cancel), a stream that reports its context's
diagnostic variable, and a generator that a cancel does not stop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from vllm_bridge.bridge import diag
from vllm_bridge.bridge.protocol.errors import CallInterrupted


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")


def fail_after(n: int, message: str) -> Iterator[int]:
    """Yield ``0 .. n-1``, then raise ``RuntimeError(message)``."""
    _check_n(n)
    yield from range(n)
    raise RuntimeError(message)


def opaques(n: int) -> Iterator[object]:
    """Yield ``n`` objects that can only travel as references (``vllm_bridge.bridge.diag.Opaque``)."""
    _check_n(n)
    for i in range(n):
        yield diag.Opaque(i)


def slow_opaque(delay: float) -> object:
    """Sleep ``delay`` seconds (``diag.sleep``), then return an object that can only travel
    as a reference. A cancel does not stop it (the interruption is caught): it stands for
    a reply that crossed its cancel, whose references the Elixir side must release."""
    try:
        diag.sleep(delay)
    except CallInterrupted:
        pass
    return diag.Opaque(delay)


def vars_seen(n: int) -> Iterator[Any]:
    """Yield the context's diagnostic variable (``diag.get_var``) ``n`` times."""
    _check_n(n)
    for _ in range(n):
        yield diag.get_var()


def stubborn(seconds: float) -> Iterator[int]:
    """Yield 0, then wait ``seconds`` catching every interruption, then yield 1. A cancel
    does not stop it: it stands for a stream stuck in C code past ``cancel_grace``."""
    yield 0
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        try:
            time.sleep(left)
        except CallInterrupted:
            pass
    yield 1
