"""Values that hold a ``msgpack.ExtType`` at a generated place, for
test_protocol_foreign.py (the encoder) and test_worker_foreign.py, whose workers
allow-list this module: :func:`value`, :func:`values` (a generator) and :class:`Holder`
(a context manager) hand back what a test put in :data:`VALUES`.

:func:`nest` puts a value a number of containers down (lists, tuples, dict values, dict
keys, fields of :class:`Box`, a registered dataclass: it travels by value), among plain
siblings, some of whose bytes are those of an ext's or a timestamp's header, and says
where it put it, as the worker names a place in a reply (``[2]['k'].item``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from vllm_bridge.bridge.protocol import Atom

#: Every code an ext can have: the application range and msgpack's reserved negative one
#: (``ExtType`` itself takes 0-127 only; ``_make`` takes any).
CODES = [*range(128), -1, -2, -56, -128]

#: What a value returned by the worker's call of value(i) etc. is, by i.
VALUES: dict[int, Any] = {}


@dataclass
class Box:
    """A registered dataclass (this module is allow-listed): travels by value, as ext 4."""

    item: Any
    note: str = "box"


def value(i: int) -> Any:
    """``VALUES[i]``."""
    return VALUES[i]


def values(i: int) -> Iterator[Any]:
    """A plain chunk, then ``VALUES[i]``."""
    yield "first"
    yield VALUES[i]


class Holder:
    """A context manager whose ``__enter__`` gives ``VALUES[i]``."""

    def __init__(self, i: int) -> None:
        self.i = i

    def __enter__(self) -> Any:
        return VALUES[self.i]

    def __exit__(self, *exc: Any) -> bool:
        return False


def forged(code: int, data: bytes = b"\x00\x01payload") -> msgpack.ExtType:
    """An ``ExtType`` of ``code`` (a negative one too, as ``_make`` and ``_replace`` make it)."""
    return msgpack.ExtType._make((code, data))


def sibling(rng: random.Random) -> Any:
    """A plain value: a number, a string, an atom, a binary (some hold the bytes of an
    ext's or a timestamp's header), a big integer, a tensor, a tuple."""
    return rng.choice(
        [
            0, 7, 300, -1, 2**40, 2**70, 1.5, float("nan"), 0xD4, 0xC7, "s", "x" * 40,
            Atom("ok"), b"\xd4\x06a", b"\xd6\xff\x00\x00\x00\x01", b"\xc7\x03\x06abc",
            None, True, torch.arange(4, dtype=torch.int32), (1, "t"),
            [rng.random() for _ in range(rng.randrange(1, 40))],
        ]
    )  # fmt: skip


def nest(rng: random.Random, inner: Any, depth: int) -> tuple[Any, str]:
    """``inner`` ``depth`` containers down, and its path (``""``: it is the value)."""
    value, path = inner, ""
    for _ in range(depth):
        kinds = ["list", "tuple", "dict", "box"]
        try:
            hash(value)
            kinds.append("key")
        except TypeError:
            pass
        kind = rng.choice(kinds)
        if kind in ("list", "tuple"):
            items = [sibling(rng) for _ in range(rng.randrange(4))]
            at = rng.randrange(len(items) + 1)
            items.insert(at, value)
            value, path = (items if kind == "list" else tuple(items)), f"[{at}]{path}"
        elif kind == "dict":
            keys = [f"k{n}" for n in range(rng.randrange(1, 5))]
            at = rng.choice(keys)
            value, path = {k: value if k == at else sibling(rng) for k in keys}, f"[{at!r}]{path}"
        elif kind == "key":
            # Before its value, so it is the first thing met (a key is looked at first).
            value, path = {value: sibling(rng), "k": sibling(rng)}, f"<key <key>>{path}"
        else:
            value, path = Box(value), f".item{path}"
    return value, path


def pair(seed: int, code: int, depth: int) -> tuple[Any, Any, str]:
    """A generated value holding ``forged(code)``, the same value holding its data (bytes)
    in its place, and the path to it."""
    ext = forged(code)
    bad, path = nest(random.Random(seed), ext, depth)
    good, same = nest(random.Random(seed), ext.data, depth)
    assert same == path
    return bad, good, path
