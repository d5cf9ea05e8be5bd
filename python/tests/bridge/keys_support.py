"""Objects whose ``__hash__``/``__eq__`` misbehave, for the tests of map keys built from
references (python/tests/bridge/test_protocol_built_keys.py); a worker allow-lists this module
with this directory on its ``PYTHONPATH``."""

from __future__ import annotations


class NotABool:
    """What a comparison answers instead of a bool; asking whether it is true raises."""

    def __bool__(self) -> bool:
        raise RuntimeError("the truth of this comparison is ambiguous")


class OddEquality:
    """Hashes alike, compares with something that is not a bool (as a tensor does)."""

    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> NotABool:  # type: ignore[override]
        return NotABool()


class HashRaises:
    """``hash()`` raises ValueError (not TypeError)."""

    def __hash__(self) -> int:
        raise ValueError("no hash today")


class Plain:
    """An ordinary object: hashable by identity."""


def make(kind: str) -> object:
    """A new object of one of the classes above, by name."""
    return {"OddEquality": OddEquality, "HashRaises": HashRaises, "Plain": Plain}[kind]()
