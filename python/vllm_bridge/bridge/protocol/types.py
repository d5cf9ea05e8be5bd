"""Value types of the wire protocol that have no plain Python counterpart.

* :class:`Atom` - an Elixir atom (ext 1); a ``str`` subclass, so atom keys work as
  keyword names and compare equal to the plain string of the same name.
* :class:`Ref` - an object reference (ext 6): an object that lives in one worker process
  and is owned by one session.
* :class:`ExtCode` - the one table of msgpack extension codes (docs/PROTOCOL.md); msgpack's
  own ext -1 (its timestamp) is not in it: :func:`timestamp_header_in` finds its bytes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgpack

from vllm_bridge.bridge.protocol.errors import short_repr


class ExtCode(enum.IntEnum):
    """msgpack extension type codes of protocol version 1."""

    ATOM = 1
    TUPLE = 2
    TENSOR = 3
    DATACLASS = 4
    ENUM = 5
    REF = 6
    BIGINT = 7
    SLOT_TENSOR = 8


#: The most magnitude bytes a big integer (ext 7) may have, either way (32 768 bits): the
#: BEAM's codec refuses more (lib/vllm_bridge/codec/ext.ex, @bigint_max_bytes), so each
#: side refuses a larger one where it is made or read, naming its size.
BIGINT_MAX_BYTES = 4096


#: The headers msgpack reads as its timestamp (ext -1 of 4, 8 or 12 bytes, in every ext form:
#: fixext 4 and 8, ext 8, 16 and 32). Its unpacker builds a ``msgpack.Timestamp`` from them
#: without calling ``ext_hook`` (its ``timestamp`` option only picks what it becomes), and
#: its packer writes one without calling ``default``: the codec looks for these bytes.
_TIMESTAMP_HEADERS = (b"\xd6\xff", b"\xd7\xff") + tuple(
    form + n.to_bytes(size, "big") + b"\xff"
    for form, size in ((b"\xc7", 1), (b"\xc8", 2), (b"\xc9", 4))
    for n in (4, 8, 12)
)
#: A chunk of a memoryview searched at a time (``bytes.find`` takes no view: a copy each).
_CHUNK = 1 << 20
#: What a chunk repeats of the one before: a header cut at its end is found whole.
_OVERLAP = max(map(len, _TIMESTAMP_HEADERS)) - 1

#: A refusal's message for a msgpack timestamp (ext -1): the decoder's for an unknown code.
TIMESTAMP_REFUSED = (
    "unknown extension type code -1 (msgpack's timestamp, not a type of this protocol)"
)


def timestamp_header_in(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` holds the bytes of a msgpack timestamp's header somewhere (a
    header, or the same bytes inside another value: a bin's, a tensor's). A search in C,
    a byte 0xFF first (a common small request has none)."""
    if not isinstance(data, memoryview):
        # (An int looked for: `b"\xff" in data` takes ten times as long, 0.2-0.3 us.)
        return 0xFF in data and any(h in data for h in _TIMESTAMP_HEADERS)
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    return any(
        timestamp_header_in(view[i : i + _CHUNK + _OVERLAP].tobytes())
        for i in range(0, len(view), _CHUNK)
    )


#: Types of values that hold nothing (exactly these: a subclass may be anything).
_LEAVES = frozenset({str, int, float, bool, bytes, type(None)})
#: A container of at least this many items is first looked at by its items' types.
_SCAN_MIN = 16


def find_raw_ext(value: Any, struct: type | None = None) -> Any:
    """The first ``msgpack.Timestamp`` or ``msgpack.ExtType`` (what msgpack packs and
    unpacks as an ext by itself) inside ``value`` (``None`` when none), looking through
    lists, tuples and maps (keys too; subclasses as well), and the ``fields`` of values of
    type ``struct`` (the decoder's pending dataclass). A stack, not recursion: a value
    nests up to msgpack's limit. The decoder and the encoder both refuse what this finds.

    Its cost is bounded by what it is for, a body whose bytes merely hold a timestamp's
    header (a float's, a binary's): a container of at least :data:`_SCAN_MIN` items whose
    items are all plain scalars (the set of their types, one pass in C) is not walked
    item by item (a list of a million floats: 49 ms walked, 23 ms so, the same machine)."""
    stack = [value]
    leaves = _LEAVES
    while stack:
        v = stack.pop()
        t = type(v)
        if t in leaves:
            continue
        if t is msgpack.Timestamp or t is msgpack.ExtType:
            return v
        if t is list or t is tuple or isinstance(v, (list, tuple)):
            if len(v) < _SCAN_MIN or not leaves.issuperset(map(type, v)):
                stack.extend(v)
        elif t is dict or isinstance(v, dict):
            if len(v) < _SCAN_MIN or not (
                leaves.issuperset(map(type, v)) and leaves.issuperset(map(type, v.values()))
            ):
                stack.extend(v)
                stack.extend(v.values())
        elif t is struct:
            stack.append(v.fields)  # type: ignore[attr-defined]
    return None


class Atom(str):
    """An Elixir atom. Equal to (and hashes like) the ``str`` of the same name."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Atom({str.__repr__(self)})"


@dataclass(frozen=True)
class Ref:
    """A reference to an object held by a worker process.

    Attributes:
        instance: The handshake ``instance`` of the worker process that holds the object.
        ref_id: Identifier of the reference, unique within that process.
        session: The owning session (``None`` = the worker's default session).
        type_name: Qualified class name of the object (informational only), or
            ``"context"`` for the handle of an entered context manager.
    """

    instance: str
    ref_id: int
    session: str | None
    type_name: str

    def __post_init__(self) -> None:
        if not isinstance(self.instance, str):
            raise TypeError(f"Ref.instance must be a str, got {short_repr(self.instance)}")
        if isinstance(self.ref_id, bool) or not isinstance(self.ref_id, int) or self.ref_id < 0:
            raise ValueError(
                f"Ref.ref_id must be a non-negative int, got {short_repr(self.ref_id)}"
            )
        if self.session is not None and not isinstance(self.session, str):
            raise TypeError(f"Ref.session must be a str or None, got {short_repr(self.session)}")
        if not isinstance(self.type_name, str):
            raise TypeError(f"Ref.type_name must be a str, got {short_repr(self.type_name)}")


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class, as the wire spells class names."""
    return f"{cls.__module__}.{cls.__qualname__}"
