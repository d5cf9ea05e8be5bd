"""msgpack bodies -> Python values, in two steps.

1. :meth:`Decoder.decode` turns bytes into values without running any code of the
   allow-listed modules: atoms, tuples, tensors, big integers and :class:`Ref` come out
   as they are (the large tensors of a large frame are copied out of it once, see
   :mod:`~vllm_bridge.protocol.splice`); dataclass and enum values come out as
   :class:`PendingStruct` / :class:`PendingEnum` (class name and fields). Malformed
   extension payloads raise :class:`~vllm_bridge.protocol.errors.BadArgument`.
2. :func:`materialize` builds the registered classes (refusing any other name), turns
   atoms into enum members where a dataclass field is annotated with an enum, and
   optionally resolves references. The worker does this on its execution thread, inside
   the calling session.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from vllm_bridge.protocol.errors import BadArgument
from vllm_bridge.protocol.registry import TypeRegistry, coerce_atom
from vllm_bridge.protocol.splice import Spliced, splice_tensors
from vllm_bridge.protocol.tensors import decode_tensor
from vllm_bridge.protocol.types import Atom, ExtCode, Ref

#: How deeply extension values (tuples in tuples, ...) may nest inside one another.
MAX_EXT_DEPTH = 64


@dataclass(eq=False)
class PendingStruct:
    """An ext 4 value before its class is looked up: qualified name and fields."""

    name: str
    fields: dict[str, Any]


@dataclass(eq=False)
class PendingEnum:
    """An ext 5 value before its class is looked up: qualified name and member name."""

    name: str
    member: str


@dataclass
class Decoded:
    """A decoded body; ``special`` says whether :func:`materialize` has work to do."""

    value: Any
    special: bool


class Decoder:
    """Decodes msgpack bodies with the extension types of protocol version 1."""

    def decode(self, data: bytes | bytearray | memoryview) -> Decoded:
        """Decode one body.

        Raises:
            BadArgument: a malformed extension payload.
            ValueError, TypeError, ...: whatever msgpack raises for malformed msgpack.
        """
        spliced = splice_tensors(data)  # large frames: large tensors with one copy each
        p = _Pass(spliced)
        value = p.unpack(spliced.body if spliced is not None else data)
        return Decoded(value, p.special)


class _Pass:
    def __init__(self, spliced: Spliced | None = None) -> None:
        self.depth = 0
        self.special = False
        self.spliced = spliced

    def unpack(self, data: Any) -> Any:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=False, use_list=True, ext_hook=self.hook
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
            raise BadArgument(f"malformed {what} payload: {exc}") from None
        finally:
            self.depth -= 1

    def hook(self, code: int, data: bytes) -> Any:  # noqa: C901 - one branch per ext code
        if code == ExtCode.ATOM:
            try:
                return Atom(data.decode())
            except UnicodeDecodeError:
                raise BadArgument(f"atom name {data!r} is not UTF-8") from None
        if code == ExtCode.TUPLE:
            items = self.nested(data, "tuple")
            if type(items) is not list:
                raise BadArgument(f"tuple payload must be an array, got {items!r:.80}")
            return tuple(items)
        if code == ExtCode.TENSOR:
            if self.spliced is not None:
                tensor = self.spliced.lookup(data)
                if tensor is not None:
                    return tensor
            return decode_tensor(data)
        if code == ExtCode.DATACLASS:
            value = self.nested(data, "dataclass")
            if not (_is_pair(value, dict) and all(isinstance(k, str) for k in value[1])):
                raise BadArgument(
                    f"dataclass payload must be [class_name, {{field: value}}], got {value!r:.80}"
                )
            self.special = True
            return PendingStruct(value[0], value[1])
        if code == ExtCode.ENUM:
            value = self.nested(data, "enum")
            if not _is_pair(value, str):
                raise BadArgument(f"enum payload must be [class_name, member], got {value!r:.80}")
            self.special = True
            return PendingEnum(value[0], value[1])
        if code == ExtCode.REF:
            value = self.nested(data, "reference")
            if type(value) is not list or len(value) != 4:
                raise BadArgument(
                    "reference payload must be [instance, ref_id, session, type_name], "
                    f"got {value!r:.80}"
                )
            try:
                ref = Ref(value[0], value[1], value[2], value[3])
            except (TypeError, ValueError) as exc:
                raise BadArgument(f"malformed reference: {exc}") from None
            self.special = True
            return ref
        if code == ExtCode.BIGINT:
            if len(data) < 1 or data[0] not in (0, 1):
                raise BadArgument(
                    f"big integer payload must start with sign byte 0 or 1, got {data!r:.40}"
                )
            magnitude = int.from_bytes(data[1:], "big")
            return -magnitude if data[0] else magnitude
        raise BadArgument(f"unknown extension type code {code}")


def _is_pair(value: Any, second: type) -> bool:
    return (
        type(value) is list
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], second)
    )


ResolveRef = Callable[[Ref], Any]


def materialize(value: Any, registry: TypeRegistry, resolve_ref: ResolveRef | None = None) -> Any:
    """Replace pending dataclass/enum values by instances of registered classes.

    Args:
        value: A decoded value.
        registry: The classes that may be built.
        resolve_ref: Maps each :class:`Ref` to its object; ``None`` leaves references as
            they are.

    Raises:
        BadArgument: an unregistered class name, an unknown member or field, or field
            values the class refuses.
    """
    t = type(value)
    if t is list:
        return [materialize(v, registry, resolve_ref) for v in value]
    if t is dict:
        return {
            materialize(k, registry, resolve_ref): materialize(v, registry, resolve_ref)
            for k, v in value.items()
        }
    if t is tuple:
        return tuple(materialize(v, registry, resolve_ref) for v in value)
    if t is PendingStruct:
        return _build_struct(value, registry, resolve_ref)
    if t is PendingEnum:
        cls = registry.lookup(value.name)
        member = cls.__members__.get(value.member) if hasattr(cls, "__members__") else None
        if member is None:
            raise BadArgument(f"{value.name} has no member {value.member!r}")
        return member
    if t is Ref and resolve_ref is not None:
        return resolve_ref(value)
    return value


def _build_struct(
    value: PendingStruct, registry: TypeRegistry, resolve_ref: ResolveRef | None
) -> Any:
    cls = registry.lookup(value.name)
    if not dataclasses.is_dataclass(cls):
        raise BadArgument(f"{value.name} is not a dataclass")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in value.fields if k not in fields]
    if unknown:
        raise BadArgument(f"{value.name} has no field {unknown[0]!r}")
    enums = registry.enum_fields(cls)
    kwargs = {}
    for name, raw in value.fields.items():
        if not fields[name].init:
            continue  # derived in __post_init__; the constructor recomputes it
        v = materialize(raw, registry, resolve_ref)
        if name in enums:
            v = coerce_atom(v, enums[name], f"{value.name}.{name}")
        kwargs[str(name)] = v
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise BadArgument(f"cannot build {value.name} from its fields: {exc}") from None
