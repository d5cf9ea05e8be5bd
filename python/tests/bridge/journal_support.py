"""Calls that fail in several shapes with their argument a local of the failing frames, for
the tests of the worker's journal of exceptions (test_worker_journal.py,
test/runtime/shm_failed_call_test.exs): a kept exception must not keep its call's
arguments (a large tensor argument holds an argument slot while it lives)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

#: The shapes :func:`fail` raises in.
HOWS = ("raise", "nested", "from", "in_except", "through_generator")


class Failure(Exception):
    """What :func:`fail` raises."""


def fail(value: Any, how: str = "raise", depth: int = 0) -> None:
    """Raises :class:`Failure` with ``value`` a local of the raising frame and of ``depth``
    frames of its own above it, in the shape ``how`` (one of :data:`HOWS`): ``raise``;
    ``nested`` (a helper raises); ``from`` (raised from a caught one); ``in_except`` (raised
    while one is handled: its ``__context__``); ``through_generator`` (a generator that
    got ``value`` raises it out, finished)."""
    if how not in HOWS:
        raise ValueError(f"how must be one of {HOWS}, got {how!r}")
    if not isinstance(depth, int) or not 0 <= depth <= 16:
        raise ValueError(f"depth must be an int from 0 to 16, got {depth!r}")
    if depth:
        return fail(value, how, depth - 1)
    if how == "raise":
        raise Failure(f"refused a {type(value).__name__}")
    if how == "nested":
        _helper(value)
    if how == "from":
        try:
            _helper(value)
        except Failure as exc:
            raise Failure("again") from exc
    if how == "in_except":
        try:
            _helper(value)
        except Failure:
            raise Failure("while handling")  # noqa: B904 - its __context__ is the point
    for _ in _generator(value):
        pass


def _helper(value: Any) -> None:
    raise Failure(f"the helper refused a {type(value).__name__}")


def _generator(value: Any) -> Iterator[int]:
    yield 1
    raise Failure(f"the generator refused a {type(value).__name__}")
