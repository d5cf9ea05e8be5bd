"""Generators for the stream tests of the Elixir runtime (test/runtime/stream_context_test.exs).

``vllm_bridge.diag`` has no generator that fails part-way; this one does.
"""

from __future__ import annotations

from collections.abc import Iterator


def fail_after(n: int, message: str) -> Iterator[int]:
    """Yield ``0 .. n-1``, then raise ``RuntimeError(message)``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    yield from range(n)
    raise RuntimeError(message)


def opaques(n: int) -> Iterator[object]:
    """Yield ``n`` objects that can only travel as references (``vllm_bridge.diag.Opaque``)."""
    from vllm_bridge.diag import Opaque

    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    for i in range(n):
        yield Opaque(i)


def slow_opaque(delay: float) -> object:
    """Sleep ``delay`` seconds, then return an object that can only travel as a reference."""
    import time

    from vllm_bridge.diag import Opaque

    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
        raise ValueError(f"delay must be a non-negative number, got {delay!r}")
    time.sleep(delay)
    return Opaque(delay)
