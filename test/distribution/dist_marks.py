"""Targets with a side effect visible from outside the worker, for the distribution
tests (test/distribution/abandoned_request_test.exs): each creates the file it is given
the moment it starts, so a test can tell afterwards whether a request ran at all, whatever
became of its answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def _mark(path: str) -> None:
    if not isinstance(path, str) or not path:
        raise TypeError(f"path must be a non-empty str, got {path!r}")
    # "x": a second start of the same request would fail loudly, not pass unseen.
    with Path(path).open("x") as f:
        f.write("started\n")


def mark(path: str) -> str:
    """Create the file ``path`` (which must not exist) and return it."""
    _mark(path)
    return path


def mark_then_count(path: str, n: int) -> Iterator[int]:
    """Create the file ``path`` when called (before the first chunk is asked for), then
    stream ``0 .. n-1``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    _mark(path)
    return iter(range(n))
