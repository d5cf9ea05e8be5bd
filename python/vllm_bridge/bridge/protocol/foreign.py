"""Extension values the encoder did not make: a ``msgpack.ExtType`` or ``msgpack.Timestamp``
anywhere in a value to encode is refused, never sent.

msgpack's packer writes an object of exactly the class ``msgpack.ExtType`` as an extension
value of its code and payload, and a ``msgpack.Timestamp`` as ext -1, by itself: it never
asks the encoder's ``default`` (``strict_types`` or not). A value that user code returns
holding one (``msgpack.unpackb`` of bytes from elsewhere makes them: its default
``ext_hook`` is ``ExtType``) would reach the peer as one of the protocol's own values with
a payload of anyone's choosing: a reference (ext 6), a tensor in a result slot naming any
file (ext 8), an atom, a big integer. So :class:`~vllm_bridge.bridge.protocol.encoder.Encoder`
refuses the whole value with :class:`ForeignValue` (a ``TypeError``) naming what it is
and where it sits, in every frame it encodes.

How they are found, and why so (measured: bench/codec_checks/encode_ext.py):

* Not by a type of our own that the packer packs natively while a user's ``ExtType`` goes
  to ``default``: there is none. With ``strict_types=True`` (the encoder's) the packer
  packs only an object of exactly ``ExtType`` natively, and refuses a subclass that
  ``default`` returns ("can not serialize"); without it, it packs every ``ExtType``,
  subclasses included, natively. A user's ``ExtType`` is of exactly that class.
* Not by walking every value: in Python that costs two to three times the packing itself
  (a list of 1 000 ints: about 50 us against 16 us), and it would have to follow what
  the packer does with each class exactly.
* By the bytes of each level the encoder packs (the value, and each payload it packs for a
  tuple, a dataclass, ...; :meth:`_Pass.pack <vllm_bridge.bridge.protocol.encoder._Pass.pack>`),
  which hold an ext msgpack wrote by itself only if they hold a byte that can start an ext
  (0xC7-0xC9, 0xD4-0xD8): short bytes are looked at for one at once (one ``translate``
  in C; the only cost of a small reply holding no ext); when there is one, or the encoder
  made an ext there, msgpack's unpacker reads the bytes back, counting the exts it meets
  (it does not look into an ext's payload: that level's own only), and the count must be
  the number the encoder made at that level. Exact (what is checked is what would be
  sent), for about one more packing of the level, paid by a level whose bytes hold such a
  byte (one of the encoder's own exts, floats, ints over 127, binaries). The unpacker
  reads ext -1 of 4, 8 or 12 bytes as a Timestamp without the hook: those are looked for
  in what it read when the bytes hold a timestamp's header; ext -1 of another length it
  refuses to read.
* A level of at least :data:`WALK_MIN_BYTES` bytes, or one where the encoder made an ext,
  is first walked, up to :data:`WALK_BUDGET` items of its lists and dicts (what the packer
  walks itself; a subclass of either, whose copy ``default`` hands the packer, sends the
  level to its bytes): a few values of many bytes (a large binary, string or inline
  tensor), or a reply of a tuple or a tensor, are decided so without reading their
  bytes again.

Only a refusal walks the whole value, to name where the first such object sits.
"""

from __future__ import annotations

from typing import Any

import msgpack

from vllm_bridge.bridge.protocol import paths
from vllm_bridge.bridge.protocol.errors import short_repr
from vllm_bridge.bridge.protocol.types import (
    LEAVES,
    ExtCode,
    find_raw_ext,
    qualified_name,
    timestamp_header_in,
)

#: The most values a refusal's walk looks at to name where the object sits.
FIND_LIMIT = 1_000_000


class ForeignValue(TypeError):
    """A value holds an extension value the encoder did not make: ``value`` is it (``None``
    when it could not be found again), ``what`` says what it is and why it is refused,
    ``where`` where it sits."""

    def __init__(self, value: Any, what: str, where: str) -> None:
        super().__init__(f"{where} is {what}")
        self.value = value
        self.what = what


#: The bytes that can start an ext (fixext 1-16, ext 8/16/32) -> 0xFF, any other -> 0.
_EXT_START = bytes(
    0xFF if b in (0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8) else 0 for b in range(256)
)
#: A level of at least this many bytes, or one where the encoder made an ext, is first
#: looked at through its value (a walk of at most :data:`WALK_BUDGET` items); a shorter
#: one without such an ext is looked at byte by byte at once.
WALK_MIN_BYTES = 256
WALK_BUDGET = 16
_ExtType, _Timestamp = msgpack.ExtType, msgpack.Timestamp


def holds_foreign(data: bytes, made: int, value: Any) -> bool:
    """Whether ``data``, ``value`` packed as one level, holds an extension value the encoder
    did not make, given that it made ``made`` of them there (see the module's docstring)."""
    # Two ways to ask whether a byte that can start an ext is there: below WALK_MIN_BYTES
    # one translate (a copy of the level) and one search; above, eight searches that copy
    # nothing.
    if not made and len(data) < WALK_MIN_BYTES:
        if 0xFF not in data.translate(_EXT_START):
            return False
    else:
        found = _walked(value)
        if found is not None:
            return found
        if not made and not (
            0xD4 in data or 0xD5 in data or 0xD6 in data or 0xD7 in data
            or 0xD8 in data or 0xC7 in data or 0xC8 in data or 0xC9 in data
        ):  # fmt: skip
            return False
    met = 0

    def count(code: int, payload: bytes) -> None:
        nonlocal met
        met += 1

    try:
        # Arrays as tuples and maps as tuples of pairs: nothing read back is hashed, so
        # no key of any kind can fail.
        tree = msgpack.unpackb(
            data, raw=True, use_list=False, strict_map_key=False, ext_hook=count,
            object_pairs_hook=tuple,
        )  # fmt: skip
    except ValueError:  # an ext -1 of a length no timestamp has: never one of ours
        return True
    if met != made:
        return True
    return timestamp_header_in(data) and find_raw_ext(tree) is not None


def _walked(value: Any) -> bool | None:
    """Whether msgpack packed an ``ExtType`` or ``Timestamp`` by itself as part of ``value``
    (one level), found by walking what it packs natively there: its lists and dicts, keys
    too (a tuple's or dataclass's items are packed one level down, checked there);
    ``None`` when that is more than :data:`WALK_BUDGET` items, or holds a list or dict
    subclass (whose copy the encoder's ``default`` hands the packer). For a level of a few
    values whose bytes are many (a large binary, string or tensor), instead of reading
    them all."""
    budget = WALK_BUDGET
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is list:
            budget -= len(v)
            if budget < 0:
                return None
            stack.extend(v)
        elif t is dict:
            budget -= 2 * len(v)
            if budget < 0:
                return None
            stack.extend(v)
            stack.extend(v.values())
        elif t is _ExtType or t is _Timestamp:
            return True
        elif t not in LEAVES and isinstance(v, (list, dict)):
            return None
    return False


def refusal(root: Any, value: Any = None) -> ForeignValue:
    """The error for the first ``msgpack.ExtType`` or ``msgpack.Timestamp`` inside ``root``
    (``value`` when the encoder met it itself: an ``ExtType`` subclass)."""
    if value is None:
        found = paths.find(root, is_foreign, FIND_LIMIT)
    else:
        found = paths.find(root, lambda v: v is value, FIND_LIMIT)
    if found is None:  # the walk sees other items than the packer did, or too many
        return ForeignValue(value, describe(value), "a value inside the value encoded")
    value, path = found
    where = f"the value encoded (at {path})" if path else "the value encoded"
    return ForeignValue(value, describe(value), where)


def is_foreign(value: Any) -> bool:
    """Whether msgpack would pack ``value`` as an ext by itself (or an ``ExtType`` subclass)."""
    return isinstance(value, msgpack.ExtType) or type(value) is msgpack.Timestamp


#: What the peer reads each of the protocol's exts as (docs/PROTOCOL.md's table).
_NAMES = {
    ExtCode.ATOM: "an atom",
    ExtCode.TUPLE: "a tuple",
    ExtCode.TENSOR: "a tensor",
    ExtCode.DATACLASS: "a dataclass",
    ExtCode.ENUM: "an enum member",
    ExtCode.REF: "an object reference",
    ExtCode.BIGINT: "a big integer",
    ExtCode.SLOT_TENSOR: "a tensor in a result slot",
}


def describe(value: Any) -> str:
    """What ``value`` is, and why it cannot be sent."""
    if isinstance(value, msgpack.ExtType):
        code = short_repr(value.code, 20)
        name = _NAMES.get(value.code) if type(value.code) is int else None
        read = (
            f"which the peer would read as {name} of the protocol's (only the encoder makes those)"
            if name is not None
            else "which is not in the protocol's table"
        )
        size = len(value.data) if isinstance(value.data, (bytes, bytearray)) else "?"
        cls = "msgpack.ExtType" if type(value) is msgpack.ExtType else qualified_name(type(value))
        return (
            f"a {cls} (code {code}, {size} bytes of data), which has no encoding in this "
            f"protocol: msgpack would write it by itself as ext {code}, {read}; return "
            "plain values instead (its data as bytes, say)"
        )
    if type(value) is msgpack.Timestamp:
        return (
            f"a msgpack Timestamp ({short_repr(value, 80)}), which has no encoding in this "
            "protocol (ext -1 is not in its table); convert it first (to_unix_nano(), say)"
        )
    return "an extension value the encoder did not make (msgpack packed it by itself)"
