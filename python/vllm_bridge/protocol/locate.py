"""Where a body that could not be decoded went wrong, and how to say so.

Decoding a request is one fast call into the C msgpack unpacker, which reports a failure
without a position (``unhashable type: 'list'``, ``StackError``). On that path only,
:func:`locate` takes the body apart again, field by field and argument by argument, and
decodes each piece with a lenient pass that keeps maps as lists of pairs, so that it can
name the argument and the path inside it: ``args[0][:a][2]``.

The helpers that describe a bad map key (:func:`unhashable_key`, :func:`colliding_keys`)
are shared with the decoder, so both paths say the same thing. Values are written as the
Elixir caller wrote them (``:a``, ``"a"``, ``{1, 2}``, ``%{}``), since that is who reads it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgpack

from vllm_bridge.protocol.errors import BadArgument, safe_str, short_repr
from vllm_bridge.protocol.types import Atom, Ref

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


def hashable(value: Any) -> bool:
    """Whether ``value`` can be a dict key."""
    try:
        hash(value)
    except TypeError:
        return False
    return True


#: How deep the descriptions below look into a value (a key may hold a list nested a
#: thousand levels down; beyond this it is written "...").
_DEPTH = 8
#: How many values the search for the unhashable part of a key looks at.
_SEARCH = 10_000
#: Tuples (extension values) nest at most this deep in a request (decoder.MAX_EXT_DEPTH).
_TUPLE_DEPTH = 64


def wire_repr(value: Any, limit: int = 60) -> str:
    """``value`` as the Elixir side writes it, cut to about ``limit`` characters."""
    text = _repr(value, limit, _DEPTH)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _repr(v: Any, limit: int, depth: int) -> str:
    from vllm_bridge.protocol.decoder import Pairs  # decoder imports this module

    if v is None:
        return "nil"
    if v is True or v is False:
        return "true" if v else "false"
    if isinstance(v, Atom):
        return ":" + str(v)[:limit]
    if isinstance(v, str):
        return '"' + v[:limit].replace('"', '\\"') + '"'
    if isinstance(v, (bytes, bytearray)):
        return "<<" + ", ".join(str(b) for b in bytes(v[:16])) + (", ...>>" if len(v) > 16 else ">>")
    if isinstance(v, Ref):  # as messages name references elsewhere
        return f"reference {v.ref_id} ({v.type_name[:limit]})"
    if isinstance(v, (Pairs, dict, tuple, list)) and depth <= 0:
        return "..."
    if isinstance(v, Pairs):
        items = v[:8]
    elif isinstance(v, dict):
        items = list(v.items())[:8]
    else:
        items = None
    if items is not None:
        inner = ", ".join(f"{_repr(k, limit, depth - 1)} => {_repr(x, limit, depth - 1)}" for k, x in items)
        return "%{" + inner + "}"
    if isinstance(v, tuple):
        return "{" + ", ".join(_repr(x, limit, depth - 1) for x in v[:8]) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_repr(x, limit, depth - 1) for x in v[:8]) + "]"
    return short_repr(v, limit)


def _kind(value: Any) -> str:
    """``is a list``, or for a tuple ``holds a map (%{})``: what makes it unhashable."""
    from vllm_bridge.protocol.decoder import Pairs

    if isinstance(value, (Pairs, dict)):
        return "is a map"
    if isinstance(value, list):
        return "is a list"
    inner = _unhashable_part(value)
    if inner is not None and inner is not value:
        what = "a map" if isinstance(inner, (Pairs, dict)) else "a list"
        return f"holds {what} ({wire_repr(inner, 20)})"
    return f"is a {type(value).__qualname__}, which is not hashable"


def _unhashable_part(value: Any) -> Any:
    """The first list or map inside ``value`` (itself, or inside its tuples), looked for
    without recursion: a tuple may hold a list nested a thousand levels down."""
    stack = [value]
    for _ in range(_SEARCH):
        if not stack:
            break
        v = stack.pop()
        if isinstance(v, (list, dict)):
            return v
        if isinstance(v, tuple):
            stack.extend(reversed(v))
    return None


def unhashable_key(key: Any) -> str:
    """Why ``key`` cannot be a dict key."""
    return (
        f"the map key {wire_repr(key)} {_kind(key)}: Python cannot hash it, so it "
        "cannot be a dict key (a tuple of plain values can be)"
    )


def colliding_keys(pairs: list[tuple[Any, Any]]) -> str:
    """Names the first two keys of ``pairs`` (decoded wire values) that are equal in
    Python, and why."""
    seen: dict[Any, Any] = {}
    for key, _ in pairs:
        if key in seen:
            return collision(seen[key], key)
        seen[key] = key
    return "the map repeats a key"


def collision(first: Any, key: Any) -> str:
    """Why ``key`` cannot join a dict that holds ``first``, which it equals."""
    return (
        f"the map keys {wire_repr(first)} and {wire_repr(key)} are equal in Python "
        f"({why_equal(first, key)}), so a dict would keep only one of them: give "
        "each its own key"
    )


def uncomparable_key(key: Any, exc: BaseException) -> str:
    """Why ``key`` (a built object) cannot be a dict key: its ``__hash__`` or
    ``__eq__`` raised ``exc`` (or answered with something that is not a bool)."""
    return (
        f"the map key {wire_repr(key)} cannot be a dict key: hashing it or comparing it "
        f"with another key raised {type(exc).__name__}: {safe_str(exc):.200}"
    )


def why_equal(a: Any, b: Any) -> str:
    """Why the keys ``a`` and ``b`` (equal in Python) collide, exactly: the same key twice,
    or which of Python's equalities makes two different wire values one key."""
    if _same_on_wire(a, b, 0):
        return "the key is repeated"
    ta, tb = type(a), type(b)
    if ta is bool or tb is bool:
        return "true == 1 and false == 0"
    if ta is float and tb is float:
        return "0.0 and -0.0 are equal: the float zero has two signs"
    if {ta, tb} <= {int, float}:
        return "a float equal to an integer is that integer"
    if {ta, tb} == {str, Atom}:
        return "an atom arrives as the string of its name"
    if ta is tuple and tb is tuple and len(a) == len(b):
        # The first pair of elements that differ on the wire, inside nested tuples too.
        for _ in range(_TUPLE_DEPTH):
            x, y = next(((x, y) for x, y in zip(a, b) if not _same_on_wire(x, y, 0)), (a, b))
            if not (type(x) is tuple and type(y) is tuple and len(x) == len(y)) or x is a:
                break
            a, b = x, y
        if x is not a:
            return (
                f"their elements {wire_repr(x, 20)} and {wire_repr(y, 20)} collide: "
                f"{why_equal(x, y)}"
            )
    if a is b:
        return "they are one object (two references to it)"
    return "Python compares them equal"


def _same_on_wire(a: Any, b: Any, depth: int) -> bool:
    """Whether ``a`` and ``b`` are one value on the wire: same types all the way down,
    floats bit for bit (``0.0`` and ``-0.0`` are two)."""
    t = type(a)
    if t is not type(b) or depth > _TUPLE_DEPTH:
        return False
    if t is float:
        return struct.pack(">d", a) == struct.pack(">d", b)
    if t is tuple:
        return len(a) == len(b) and all(_same_on_wire(x, y, depth + 1) for x, y in zip(a, b))
    if t in (int, str, Atom, bytes, bool, type(None)):
        return bool(a == b)
    return False


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
    :class:`~vllm_bridge.protocol.decoder.Pairs` and raises for anything else it cannot
    decode.
    """
    data = bytes(body)
    u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1))
    u.feed(data)
    try:
        n = u.read_array_header()
        kind = u.unpack()
        u.skip()  # the id
    except Exception:  # noqa: BLE001 - not a request: nothing to locate
        return None
    names = _FIELDS.get(kind, ()) if isinstance(kind, str) else ()
    for i in range(n - 2):
        name = names[i] if i < len(names) else f"field {i + 2}"
        try:
            if name == "args" and _is_array(data, u.tell()):
                found = _each_element(u, data, name, lenient)
            elif name == "kwargs" and _is_map(data, u.tell()):
                found = _each_value(u, data, name, lenient)
            else:
                found = _one(u, data, name, lenient)
        except _Unreadable:
            return (name, None)
        if found is not None:
            return found
    return None


class _Unreadable(Exception):
    """The body's structure itself is broken at this field: nothing further to locate."""


def _is_array(data: bytes, pos: int) -> bool:
    return pos < len(data) and (0x90 <= data[pos] <= 0x9F or data[pos] in (0xDC, 0xDD))


def _is_map(data: bytes, pos: int) -> bool:
    return pos < len(data) and (0x80 <= data[pos] <= 0x8F or data[pos] in (0xDE, 0xDF))


def _each_element(u: msgpack.Unpacker, data: bytes, name: str, lenient: Callable[[], Any]) -> Found | None:
    for i in range(u.read_array_header()):
        found = _one(u, data, f"{name}[{i}]", lenient)
        if found is not None:
            return found
    return None


def _each_value(u: msgpack.Unpacker, data: bytes, name: str, lenient: Callable[[], Any]) -> Found | None:
    for _ in range(u.read_map_header()):
        try:
            key = u.unpack()  # a keyword argument's name: a short str
        except Exception as exc:  # noqa: BLE001
            return (f"a key of {name}", describe_failure(exc))
        found = _one(u, data, f"{name}[{wire_repr(key)}]", lenient)
        if found is not None:
            return found
    return None


def _one(u: msgpack.Unpacker, data: bytes, path: str, lenient: Callable[[], Any]) -> Found | None:
    """Skip the next value (no objects built), then decode its bytes on their own."""
    start = u.tell()
    try:
        u.skip()
    except msgpack.exceptions.StackError as exc:
        return (path, describe_failure(exc))
    except Exception as exc:  # noqa: BLE001 - truncated or malformed structure
        raise _Unreadable() from exc
    raw = data[start : u.tell()]
    try:
        value = lenient().unpack(raw)
    except Exception as exc:  # noqa: BLE001 - a bad extension value, too deep, ...
        return (path, describe_failure(exc))
    try:
        return _first_bad_map(value, path)
    except RecursionError:
        return (path, describe_failure(msgpack.exceptions.StackError()))


def _first_bad_map(value: Any, path: str) -> Found | None:
    """The first map under ``value`` with a key Python cannot hash or two equal keys."""
    from vllm_bridge.protocol.decoder import Pairs, PendingStruct

    if isinstance(value, Pairs):
        for key, _ in value:
            if not hashable(key):
                return (path, unhashable_key(key))
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
