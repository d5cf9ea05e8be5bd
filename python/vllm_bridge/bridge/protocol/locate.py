"""Where a body that could not be decoded went wrong, and how to say so.

Decoding a request is one fast call into the C msgpack unpacker, which reports a failure
without a position (``unhashable type: 'list'``, ``StackError``). On that path only,
:func:`locate` takes the body apart again, field by field and argument by argument, and
decodes each piece with a lenient pass that keeps maps as lists of pairs, so that it can
name the argument and the path inside it: ``args[0][:a][2]``.

What it says about a bad map key comes from :mod:`~vllm_bridge.bridge.protocol.describe`, which
the decoder uses too, so both paths say the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

from vllm_bridge.bridge.protocol.describe import colliding_keys, hashable, unhashable_key, wire_repr
from vllm_bridge.bridge.protocol.errors import BadArgument
from vllm_bridge.bridge.protocol.slots import split_payload
from vllm_bridge.bridge.protocol.tensors import check_tensor_payload, parse_slot_header
from vllm_bridge.bridge.protocol.types import TIMESTAMP_REFUSED, ExtCode

#: msgpack's own nesting limit for one value (the C unpacker's stack).
MSGPACK_DEPTH = 1024

#: The request fields after ``[kind, id`` (docs/PROTOCOL.md, "Messages").
_FIELDS = {
    "call": ("session", "timeout", "target", "args", "kwargs"),
    "stream": ("session", "timeout", "target", "args", "kwargs"),
    "enter": ("session", "timeout", "target", "args", "kwargs"),
    "get": ("session", "timeout", "target"),
    "exit": ("session", "timeout", "handle", "exc"),
    "release": ("session", "refs"),
    "close": ("session",),
    "credit": ("n",),
    "hello": ("info",),
}

Found = tuple[str, "str | None"]


def describe_failure(exc: BaseException) -> str:
    """What a decode failure means, in the caller's terms."""
    if isinstance(exc, msgpack.exceptions.StackError):
        return (
            f"it nests deeper than msgpack's limit of {MSGPACK_DEPTH} levels (a request's "
            "arguments may nest at most 64 levels: docs/PROTOCOL.md)"
        )
    if isinstance(exc, msgpack.exceptions.ExtraData):
        return "bytes follow the end of the message"
    text = str(exc)
    if "incomplete input" in text:
        return "the frame ends in the middle of a value"
    if isinstance(exc, BadArgument):
        return text
    return f"malformed msgpack ({type(exc).__name__}: {text})" if text else type(exc).__name__


def locate(
    body: bytes | bytearray | memoryview, lenient: Callable[[], Any], exc: BaseException
) -> Found | None:
    """``(where, what)`` of the first value of a request that cannot be decoded, or
    ``None`` when the body is not a request whose fields can be told apart. ``what`` is
    ``None`` when the piece fails in the same way as the whole (``exc`` says it).

    ``lenient()`` makes a decoding pass whose ``unpack`` keeps maps as
    :class:`~vllm_bridge.bridge.protocol.decoder.Pairs` and raises for anything else it cannot
    decode.

    The body is read where it lies (a frame can be a GiB): the walk reads headers only,
    and decodes each argument on its own, except those that cannot hold a bad value
    (binaries, numbers, a sound tensor), which it only checks in place.
    """
    cur = _Cursor(memoryview(body).cast("B") if isinstance(body, memoryview) else memoryview(body))
    try:
        n = cur.array_header()
        kind = cur.small_value()
        cur.skip()  # the id
    except Exception:  # noqa: BLE001 - not a request: nothing to locate
        return None
    names = _FIELDS.get(kind, ()) if isinstance(kind, str) else ()
    for i in range(n - 2):
        name = names[i] if i < len(names) else f"field {i + 2}"
        try:
            if name == "args" and cur.at_array():
                found = _each_element(cur, name, lenient)
            elif name == "kwargs" and cur.at_map():
                found = _each_value(cur, name, lenient)
            else:
                found = _one(cur, name, lenient)
        except _Unreadable:
            return (name, None)
        if found is not None:
            return found
    return None


class _Unreadable(Exception):
    """The body's structure itself is broken at this field: nothing further to locate."""


#: Type bytes of values of a fixed size after the type byte (floats, ints, fixext).
_FIXED = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4,
          0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}  # fmt: skip
#: Type bytes followed by a length (of this many bytes), then that many bytes (bin, str),
#: or a type code and that many bytes (ext).
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4}
#: Arrays and maps with a counted length: (bytes of the count, items per count).
_COUNTED = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


class _Cursor:
    """Reads msgpack in place: headers, and where each value ends, without decoding it
    (msgpack's Unpacker would first copy the whole body into a buffer of its own)."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def _byte(self, pos: int) -> int:
        if pos >= len(self.data):
            raise _Unreadable()
        return self.data[pos]

    def _uint(self, pos: int, size: int) -> int:
        if pos + size > len(self.data):
            raise _Unreadable()
        return int.from_bytes(self.data[pos : pos + size], "big")

    def head(self, pos: int) -> tuple[int, int]:
        """``(items, end)`` of the value at ``pos``: the values an array or map holds
        (a map's keys and values both count), and where its own bytes end (for a
        container, where its first item starts)."""
        b = self._byte(pos)
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            return 0, pos + 1
        if b <= 0x8F:
            return 2 * (b & 0x0F), pos + 1
        if b <= 0x9F:
            return b & 0x0F, pos + 1
        if b <= 0xBF:
            return 0, pos + 1 + (b & 0x1F)
        if b in _FIXED:
            return 0, pos + 1 + _FIXED[b]
        if b in _SIZED:
            size = _SIZED[b]
            return 0, pos + 1 + size + self._uint(pos + 1, size)
        if b in _EXT:
            size = _EXT[b]
            return 0, pos + 2 + size + self._uint(pos + 1, size)
        if b in _COUNTED:
            size, per = _COUNTED[b]
            return per * self._uint(pos + 1, size), pos + 1 + size
        raise _Unreadable()  # 0xC1, never used

    def skip(self) -> int:
        """Step over the value at the cursor (however deep, without recursion); returns
        where it started."""
        start = pos = self.pos
        pending = 1
        while pending:
            items, pos = self.head(pos)
            pending += items - 1
        if pos > len(self.data):
            raise _Unreadable()
        self.pos = pos
        return start

    def raw(self) -> memoryview:
        """The bytes of the value at the cursor, stepped over."""
        start = self.skip()
        return self.data[start : self.pos]

    def small_value(self) -> Any:
        """Decode the (small) value at the cursor: a kind, an id, a keyword's name."""
        return msgpack.unpackb(self.raw(), raw=False, strict_map_key=False)

    def array_header(self) -> int:
        if not self.at_array():
            raise _Unreadable()
        items, self.pos = self.head(self.pos)
        return items

    def map_header(self) -> int:
        if not self.at_map():
            raise _Unreadable()
        items, self.pos = self.head(self.pos)
        return items // 2

    def at_array(self) -> bool:
        b = self.data[self.pos] if self.pos < len(self.data) else -1
        return 0x90 <= b <= 0x9F or b in (0xDC, 0xDD)

    def at_map(self) -> bool:
        b = self.data[self.pos] if self.pos < len(self.data) else -1
        return 0x80 <= b <= 0x8F or b in (0xDE, 0xDF)


def _each_element(cur: _Cursor, name: str, lenient: Callable[[], Any]) -> Found | None:
    for i in range(cur.array_header()):
        found = _one(cur, f"{name}[{i}]", lenient)
        if found is not None:
            return found
    return None


def _each_value(cur: _Cursor, name: str, lenient: Callable[[], Any]) -> Found | None:
    for _ in range(cur.map_header()):
        try:
            key = cur.small_value()  # a keyword argument's name: a short str
        except _Unreadable:
            raise
        except Exception as exc:  # noqa: BLE001
            return (f"a key of {name}", describe_failure(exc))
        if type(key) is msgpack.Timestamp:
            return (f"a key of {name}", TIMESTAMP_REFUSED)
        found = _one(cur, f"{name}[{wire_repr(key)}]", lenient)
        if found is not None:
            return found
    return None


def _one(cur: _Cursor, path: str, lenient: Callable[[], Any]) -> Found | None:
    """Step over the next value (nothing decoded), then decode its bytes on their own,
    unless they cannot hold what fails (see :func:`_holds_nothing`)."""
    raw = cur.raw()
    try:
        if _holds_nothing(raw):
            return None
    except BadArgument as exc:  # a tensor's
        return (path, str(exc))
    try:
        value = lenient().unpack(raw)
    except Exception as exc:  # noqa: BLE001 - a bad extension value, too deep, ...
        return (path, describe_failure(exc))
    try:
        return _first_bad_map(value, path)
    except RecursionError:
        return (path, describe_failure(msgpack.exceptions.StackError()))


def _holds_nothing(raw: memoryview) -> bool:
    """Whether a value cannot fail to decode, so need not be decoded to be looked at: a
    binary, a number, nil or a boolean, or a tensor that decodes (checked in place, raising
    :class:`BadArgument` as decoding would). A str is decoded (its UTF-8 may
    be bad), and so is anything that may hold a map."""
    b = raw[0]
    if b in (0xC4, 0xC5, 0xC6, 0xC0, 0xC2, 0xC3) or b <= 0x7F or b >= 0xE0:
        return True
    if b in _FIXED and not 0xD4 <= b <= 0xD8:
        return True
    if b in _EXT or 0xD4 <= b <= 0xD8:
        size = _EXT.get(b, 0)
        code = raw[1 + size]
        if code == ExtCode.TENSOR:
            check_tensor_payload(raw[2 + size :])
            return True
        if code == ExtCode.SLOT_TENSOR:  # its slot was read by the first pass: the header
            parse_slot_header(split_payload(raw[2 + size :])[0])
            return True
    return False


def _first_bad_map(value: Any, path: str) -> Found | None:
    """The first map under ``value`` with a key Python cannot hash or two equal keys, or
    the first msgpack timestamp (ext -1, which msgpack decodes without the ext hook)."""
    from vllm_bridge.bridge.protocol.decoder import Pairs
    from vllm_bridge.bridge.protocol.materialize import PendingStruct

    if type(value) is msgpack.Timestamp:
        return (path, TIMESTAMP_REFUSED)
    if isinstance(value, Pairs):
        for key, _ in value:
            if not hashable(key):
                return (path, unhashable_key(key))
            if type(key) is msgpack.Timestamp:
                return (f"a key of {path}", TIMESTAMP_REFUSED)
        if len({k for k, _ in value}) != len(value):
            return (path, colliding_keys(list(value)))
        for key, item in value:
            found = _first_bad_map(item, f"{path}[{wire_repr(key)}]")
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _first_bad_map(item, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(value, PendingStruct):
        for name, item in value.fields.items():
            found = _first_bad_map(item, f"{path}.{name}")
            if found is not None:
                return found
    return None
