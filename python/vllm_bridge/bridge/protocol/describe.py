"""How refusals describe values and map keys, in the caller's terms: values are written
as the Elixir caller wrote them (``:a``, ``"a"``, ``{1, 2}``, ``%{}``), since that is who
reads them, and every description is bounded (a key may hold a list nested a thousand
levels down, or a string of a megabyte).

Shared by the decoder (:mod:`~vllm_bridge.bridge.protocol.decoder`, when it refuses a map) and
by :mod:`~vllm_bridge.bridge.protocol.locate` (when it finds where), so both say the same thing.
"""

from __future__ import annotations

import struct
from typing import Any

from vllm_bridge.bridge.protocol.errors import safe_str, short_repr
from vllm_bridge.bridge.protocol.types import Atom, Ref

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
    from vllm_bridge.bridge.protocol.decoder import Pairs  # decoder imports this module

    if v is None:
        return "nil"
    if v is True or v is False:
        return "true" if v else "false"
    if isinstance(v, Atom):
        return ":" + str(v)[:limit]
    if isinstance(v, str):
        return '"' + v[:limit].replace('"', '\\"') + '"'
    if isinstance(v, (bytes, bytearray)):
        head = ", ".join(str(b) for b in bytes(v[:16]))
        return "<<" + head + (", ...>>" if len(v) > 16 else ">>")
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
        inner = ", ".join(
            f"{_repr(k, limit, depth - 1)} => {_repr(x, limit, depth - 1)}" for k, x in items
        )
        return "%{" + inner + "}"
    if isinstance(v, tuple):
        return "{" + ", ".join(_repr(x, limit, depth - 1) for x in v[:8]) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_repr(x, limit, depth - 1) for x in v[:8]) + "]"
    return short_repr(v, limit)


def _kind(value: Any) -> str:
    """``is a list``, or for a tuple ``holds a map (%{})``: what makes it unhashable."""
    from vllm_bridge.bridge.protocol.decoder import Pairs

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
