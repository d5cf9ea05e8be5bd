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
#: The bytes 0xFF looked at one by one (from Python) before the rest are looked at together:
#: by the eleven substring searches in data shorter than :data:`_ARRAY_MIN` bytes, else
#: with numpy, a chunk at a time, the first of 64 KiB and each next one twice as long, up
#: to :data:`_CHUNK` (numpy's temporaries are chunk-sized).
_FEW = 24
_ARRAY_MIN = 1 << 12
_CHUNK = 1 << 20

#: A refusal's message for a msgpack timestamp (ext -1): the decoder's for an unknown code.
TIMESTAMP_REFUSED = (
    "unknown extension type code -1 (msgpack's timestamp, not a type of this protocol)"
)


def timestamp_header_in(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` holds the bytes of a msgpack timestamp's header somewhere (a
    header, or the same bytes inside another value: a bin's, a tensor's).

    Every header ends in its type code, the byte 0xFF: those are found in C (``find``, a
    ``memchr``; a common small request has none) and the bytes before each compared, from
    Python for the first :data:`_FEW` (see there for the rest). Each of the eleven
    substring searches, one per header, takes about 1 ns a byte here: 0.08 ms for a reply
    of 1 000 floats (three times its packing), 4 us so; 11 ms for a MiB without a header
    (a large tensor's bytes), well under 1 ms with numpy."""
    if type(data) is memoryview:
        if data.nbytes >= _CHUNK:
            return _header_in_array(data, 1)
        data = data.tobytes()
    pos = data.find(0xFF, 1)  # a header has at least one byte before its 0xFF
    for _ in range(_FEW):
        if pos < 0:
            return False
        if _header_ends_at(data, pos):
            return True
        pos = data.find(0xFF, pos + 1)
    if pos < 0:
        return False
    if len(data) < _ARRAY_MIN:
        return any(h in data for h in _TIMESTAMP_HEADERS)
    return _header_in_array(data, pos)


def _header_ends_at(data: bytes | bytearray, pos: int) -> bool:
    """Whether the byte 0xFF at ``pos`` ends a timestamp's header (see
    :data:`_TIMESTAMP_HEADERS`): fixext 4 or 8 (d6/d7 ff), or ext 8, 16 or 32 of 4, 8
    or 12 bytes (c7 n ff, c8 00 n ff, c9 00 00 00 n ff)."""
    b = data[pos - 1]
    if b == 0xD6 or b == 0xD7:
        return True
    if b != 4 and b != 8 and b != 12:
        return False
    return (
        (pos >= 2 and data[pos - 2] == 0xC7)
        or (pos >= 3 and data[pos - 3] == 0xC8 and data[pos - 2] == 0)
        or (pos >= 5 and data[pos - 5 : pos - 1] == b"\xc9\x00\x00\x00")
    )


def _header_in_array(data: bytes | bytearray | memoryview, start: int) -> bool:
    """:func:`_header_ends_at` for every byte 0xFF from ``start`` (at least 1) on, with
    numpy, a chunk at a time (each looks back from its own 0xFF bytes: no overlap)."""
    import numpy as np  # (the worker has it loaded already: the tensors' codec)

    a = np.frombuffer(data, dtype=np.uint8)
    lo, size = start, 1 << 16
    while lo < len(a):
        ff = np.flatnonzero(a[lo : lo + size] == 0xFF) + lo
        lo, size = lo + size, min(2 * size, _CHUNK)
        if ff.size == 0:
            continue
        prev = a[ff - 1]
        if ((prev == 0xD6) | (prev == 0xD7)).any():
            return True
        sized = ff[(prev == 4) | (prev == 8) | (prev == 12)]
        at2, at3, at5 = sized[sized >= 2], sized[sized >= 3], sized[sized >= 5]
        ext32 = (a[at5 - 5] == 0xC9) & (a[at5 - 4] == 0) & (a[at5 - 3] == 0) & (a[at5 - 2] == 0)
        if (
            (a[at2 - 2] == 0xC7).any()
            or ((a[at3 - 3] == 0xC8) & (a[at3 - 2] == 0)).any()
            or ext32.any()
        ):
            return True
    return False


#: Types of values that hold nothing (exactly these: a subclass may be anything; also
#: protocol/foreign.py's).
LEAVES = frozenset({str, int, float, bool, bytes, type(None)})
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
    leaves = LEAVES
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
