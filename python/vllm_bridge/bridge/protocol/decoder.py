"""msgpack bodies -> Python values, in two steps.

1. :meth:`Decoder.decode` turns bytes into values without running any code of the
   allow-listed modules: atoms, tuples, tensors, big integers and :class:`Ref` come out
   as they are (the large tensors of a large frame are copied out of it once, see
   :mod:`~vllm_bridge.bridge.protocol.splice`); dataclass and enum values come out as
   :class:`PendingStruct` / :class:`PendingEnum` (class name and fields). A value Python
   cannot take as it was meant - a map whose key cannot be hashed, a map whose keys are
   equal once decoded (``1`` and ``True``, ``:a`` and ``"a"``), nesting past msgpack's
   limit, a malformed extension payload, msgpack's own timestamp (ext -1) - raises
   :class:`~vllm_bridge.bridge.protocol.errors.BadArgument` naming what and where
   (:mod:`~vllm_bridge.bridge.protocol.locate` finds where, on that path only); malformed
   msgpack raises :class:`~vllm_bridge.bridge.protocol.errors.ProtocolError`. A dict never
   silently keeps one of two colliding keys.
2. :func:`~vllm_bridge.bridge.protocol.materialize.materialize` (its own module)
   builds the registered classes (refusing any other name), turns atoms into enum
   members where a dataclass field is annotated with an enum, and optionally resolves
   references. The worker does this on its execution thread, inside the calling session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from vllm_bridge.bridge.protocol import describe, locate
from vllm_bridge.bridge.protocol.errors import BadArgument, ProtocolError, safe_str, short_repr
from vllm_bridge.bridge.protocol.materialize import PendingEnum, PendingStruct
from vllm_bridge.bridge.protocol.splice import SPLICE_MIN_FRAME, Spliced, splice_tensors
from vllm_bridge.bridge.protocol.slots import SlotDir, split_payload
from vllm_bridge.bridge.protocol.tensors import decode_tensor, parse_slot_header, tensor_from_slot
from vllm_bridge.bridge.protocol.types import (
    BIGINT_MAX_BYTES,
    TIMESTAMP_REFUSED,
    Atom,
    ExtCode,
    Ref,
    find_raw_ext,
    timestamp_header_in,
)

#: How deeply extension values (tuples in tuples, ...) may nest inside one another.
MAX_EXT_DEPTH = 64

__all__ = [
    "Decoded",
    "Decoder",
    "Pairs",
    "checked_dict",
    "refuse_timestamps",
    "undecodable",
]


@dataclass
class Decoded:
    """A decoded body; ``special`` says whether :func:`materialize` has work to do."""

    value: Any
    special: bool


class Decoder:
    """Decodes msgpack bodies with the extension types of protocol version 1.

    ``slots``: the slot directory tensors in slots (ext 8) are read from; without one, an
    ext 8 is refused (``BadArgument``)."""

    #: Frames shorter than this hold no tensor large enough to splice.
    SMALL = SPLICE_MIN_FRAME

    def __init__(self, slots: SlotDir | None = None) -> None:
        self.slots = slots

    def small_pass(self) -> _Pass:
        """A decoding pass for frames shorter than :attr:`SMALL`, for one thread to reuse:
        ``pass.hook`` and :func:`checked_dict` as ``msgpack.unpackb``'s ``ext_hook`` and
        ``object_pairs_hook`` (and ``strict_map_key=False``) decode as :meth:`decode` does;
        ``pass.special`` says what :attr:`Decoded.special` would (reset it before each
        use), and :func:`refuse_timestamps` refuses what msgpack decodes without the hook.
        A failure is named by :func:`undecodable`."""
        return _Pass(None, slots=self.slots)

    def decode(self, data: bytes | bytearray | memoryview) -> Decoded:
        """Decode one body.

        Raises:
            BadArgument: a value Python cannot take as it was meant (see the module
                docstring); the message names what and where (``args[0][:a]``).
            ProtocolError: the body is not well-formed msgpack.
        """
        # Large frames: large tensors with one copy each (a short frame holds none: the
        # call is skipped, one Python call fewer per small request).
        spliced = splice_tensors(data) if len(data) >= SPLICE_MIN_FRAME else None
        p = _Pass(spliced, slots=self.slots)
        body = spliced.body if spliced is not None else data
        try:
            value = p.unpack(body)
            refuse_timestamps(body, value)
        except Exception as exc:  # noqa: BLE001 - every failure is named, then re-raised
            raise undecodable(data, exc) from None
        return Decoded(value, p.special)


def undecodable(data: bytes | bytearray | memoryview, exc: Exception) -> BadArgument:
    """The error for a body that failed to decode with ``exc``: where it went wrong
    (a second, slower pass over the body, on this path only) and what."""
    what = locate.describe_failure(exc)
    where = locate.locate(data, lambda: _Pass(lenient=True), exc)
    value_error = isinstance(exc, (BadArgument, msgpack.exceptions.StackError))
    if where is not None:
        path, found = where
        message = f"could not decode {path}: {found or what}"
        # A readable envelope and a bad value inside it: the caller's argument is refused.
        return BadArgument(message) if value_error or found else ProtocolError(message)
    if value_error:
        return BadArgument(f"could not decode the frame: {what}")
    return ProtocolError(f"undecodable frame: {what}")


def refuse_timestamps(body: bytes | bytearray | memoryview, value: Any) -> None:
    """Raise :class:`BadArgument` when ``value``, decoded from ``body``, holds a
    ``msgpack.Timestamp``: msgpack decodes ext -1 itself, never asking the ext hook, and
    the protocol has no such type (nor has the Elixir codec). Only a body with the bytes of
    its header is walked."""
    if timestamp_header_in(body) and find_raw_ext(value, PendingStruct) is not None:
        raise BadArgument(TIMESTAMP_REFUSED)


class Pairs(list):  # type: ignore[type-arg]
    """A map decoded as its list of ``(key, value)`` pairs, by the lenient pass that
    :mod:`~vllm_bridge.bridge.protocol.locate` runs to find a bad key (never by the worker)."""


class _Pass:
    def __init__(
        self, spliced: Spliced | None = None, lenient: bool = False, slots: SlotDir | None = None
    ) -> None:
        self.slots = slots
        self.depth = 0
        self.special = False
        self.spliced = spliced
        self.lenient = lenient
        self.pairs = Pairs if lenient else checked_dict

    def unpack(self, data: Any) -> Any:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=False,
            use_list=True,
            ext_hook=self.hook,
            object_pairs_hook=self.pairs,
        )

    def nested(self, data: bytes, what: str) -> Any:
        if self.depth >= MAX_EXT_DEPTH:
            raise BadArgument(f"extension values nest deeper than {MAX_EXT_DEPTH} levels")
        self.depth += 1
        try:
            return self.unpack(data)
        except BadArgument:
            raise
        except Exception as exc:
            raise BadArgument(f"malformed {what} payload: {safe_str(exc):.200}") from None
        finally:
            self.depth -= 1

    def hook(self, code: int, data: bytes) -> Any:  # noqa: C901 - one branch per ext code
        if code == ExtCode.ATOM:
            try:
                return Atom(data.decode())
            except UnicodeDecodeError:
                raise BadArgument(f"atom name {short_repr(data)} is not UTF-8") from None
        if code == ExtCode.TUPLE:
            items = self.nested(data, "tuple")
            if type(items) is not list:
                raise BadArgument(f"tuple payload must be an array, got {short_repr(items)}")
            return tuple(items)
        if code == ExtCode.TENSOR:
            if self.spliced is not None:
                tensor = self.spliced.lookup(data)
                if tensor is not None:
                    return tensor
            return decode_tensor(data)
        if code == ExtCode.SLOT_TENSOR:
            return self.slot_tensor(data)
        if code == ExtCode.DATACLASS:
            value = self.nested(data, "dataclass")
            if self.lenient and _is_pair(value, Pairs):
                value[1] = dict(value[1])  # field names are str: nothing to find in them
            if not (_is_pair(value, dict) and all(isinstance(k, str) for k in value[1])):
                raise BadArgument(
                    "dataclass payload must be [class_name, {field: value}], got "
                    f"{short_repr(value)}"
                )
            self.special = True
            return PendingStruct(value[0], value[1])
        if code == ExtCode.ENUM:
            value = self.nested(data, "enum")
            if not _is_pair(value, str):
                raise BadArgument(
                    f"enum payload must be [class_name, member], got {short_repr(value)}"
                )
            self.special = True
            return PendingEnum(value[0], value[1])
        if code == ExtCode.REF:
            value = self.nested(data, "reference")
            if type(value) is not list or len(value) != 4:
                raise BadArgument(
                    "reference payload must be [instance, ref_id, session, type_name], "
                    f"got {short_repr(value)}"
                )
            try:
                ref = Ref(value[0], value[1], value[2], value[3])
            except (TypeError, ValueError) as exc:
                raise BadArgument(f"malformed reference: {safe_str(exc):.200}") from None
            self.special = True
            return ref
        if code == ExtCode.BIGINT:
            if len(data) - 1 > BIGINT_MAX_BYTES:
                raise BadArgument(
                    f"big integer of {len(data) - 1} magnitude bytes is over the protocol's "
                    f"limit of {BIGINT_MAX_BYTES} (ext 7)"
                )
            if len(data) < 1 or data[0] not in (0, 1):
                raise BadArgument(
                    "big integer payload must start with sign byte 0 or 1, got "
                    f"{short_repr(data, 40)}"
                )
            magnitude = int.from_bytes(data[1:], "big")
            return -magnitude if data[0] else magnitude
        raise BadArgument(f"unknown extension type code {code}")


    def slot_tensor(self, data: bytes) -> Any:
        header, name = split_payload(data)
        _dtype, _shape, nbytes = parse_slot_header(header)
        if self.lenient:
            return None  # locating a bad value: the slot was read (and handed back) already
        if self.slots is None:
            raise BadArgument(
                f"a tensor in the slot {name!r} (ext 8) arrived, but this worker has no slot "
                "directory (VLLM_BRIDGE_SHM_DIR)"
            )
        return tensor_from_slot(self.slots.read(name, nbytes), header)


def checked_dict(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """The dict of a decoded map; refuses a key Python cannot hash and keys that are
    equal once decoded (a plain dict would keep the last of them, silently)."""
    if not pairs:  # the common empty kwargs: a third of the hook's cost
        return {}
    try:
        d = dict(pairs)
    except TypeError:
        bad = next(k for k, _ in pairs if not describe.hashable(k))
        raise BadArgument(describe.unhashable_key(bad)) from None
    if len(d) != len(pairs):
        raise BadArgument(describe.colliding_keys(pairs))
    return d


def _is_pair(value: Any, second: type) -> bool:
    return (
        type(value) is list
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], second)
    )
