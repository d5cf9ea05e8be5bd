"""Step 2 of decoding (:mod:`~vllm_bridge.bridge.protocol.decoder` is step 1): decoded
values -> the objects they stand for. :func:`materialize` builds the registered classes of
the :class:`PendingStruct` / :class:`PendingEnum` values the decoder leaves (refusing any
other name), turns atoms into enum members where a dataclass field is annotated with an
enum, and optionally resolves references; :func:`materialize_field` names where in a
request's field a refusal sits (``args[1][:a].level``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_bridge.bridge.protocol import describe
from vllm_bridge.bridge.protocol.errors import BadArgument, safe_str, short_repr
from vllm_bridge.bridge.protocol.registry import TypeRegistry, coerce_atom
from vllm_bridge.bridge.protocol.types import Ref


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


ResolveRef = Callable[[Ref], Any]


def materialize(value: Any, registry: TypeRegistry, resolve_ref: ResolveRef | None = None) -> Any:
    """Replace pending dataclass/enum values by instances of registered classes.

    Args:
        value: A decoded value.
        registry: The classes that may be built.
        resolve_ref: Maps each :class:`Ref` to its object; ``None`` leaves references as
            they are.

    Raises:
        BadArgument: an unregistered class name, an unknown member or field, field values
            the class refuses, or map keys that cannot be hashed or are equal once built
            (two references to one object, say). ``steps`` on the exception locate the
            value inside ``value`` (see :func:`materialize_field`).
    """
    t = type(value)
    if t is list or t is tuple:
        items = []
        for i, v in enumerate(value):
            try:
                items.append(materialize(v, registry, resolve_ref))
            except BadArgument as exc:
                raise _step(exc, f"[{i}]") from None
        return items if t is list else tuple(items)
    if t is dict:
        return _build_dict(value, registry, resolve_ref)
    if t is PendingStruct:
        return _build_struct(value, registry, resolve_ref)
    if t is PendingEnum:
        cls = registry.lookup(value.name)
        member = cls.__members__.get(value.member) if hasattr(cls, "__members__") else None
        if member is None:
            raise BadArgument(f"{value.name:.200} has no member {short_repr(value.member)}")
        return member
    if t is Ref and resolve_ref is not None:
        return resolve_ref(value)
    return value


def _build_dict(
    value: dict[Any, Any], registry: TypeRegistry, resolve_ref: ResolveRef | None
) -> Any:
    """The dict of a decoded map with its keys and values built. Building can make keys
    collide (two references to one object) or make them unhashable; a built key is an
    object of the allow-listed code, whose ``__hash__``/``__eq__`` may raise or answer
    with something that is not a bool: each is a refusal naming the key, never an error
    of the worker. The key's place is written only when something fails."""
    built: dict[Any, Any] = {}
    first: dict[Any, Any] = {}  # each built key, by itself: finds the one a key equals
    for k, v in value.items():
        try:
            key = materialize(k, registry, resolve_ref)
            try:
                other = first.get(key, _NONE)
            except TypeError as exc:
                if not describe.hashable(key):
                    raise BadArgument(describe.unhashable_key(key)) from None
                raise BadArgument(describe.uncomparable_key(key, exc)) from None
            except Exception as exc:  # noqa: BLE001 - the key's own __hash__ or __eq__
                raise BadArgument(describe.uncomparable_key(key, exc)) from None
            if other is not _NONE:
                raise BadArgument(describe.collision(other, key))
            first[key] = key
            built[key] = materialize(v, registry, resolve_ref)
        except BadArgument as exc:
            raise _step(exc, f"[{describe.wire_repr(k)}]") from None
    return built


#: No key found (``None`` may be a key).
_NONE = object()


def materialize_field(
    value: Any, name: str, registry: TypeRegistry, resolve_ref: ResolveRef | None = None
) -> Any:
    """:func:`materialize` for one field of a request (``name``: ``"args"``,
    ``"kwargs"``); a refusal names where in it (``args[1][:a].level``)."""
    try:
        return materialize(value, registry, resolve_ref)
    except RecursionError:
        raise BadArgument(f"{name} nests too deeply to be built") from None
    except BadArgument as exc:
        steps = getattr(exc, "steps", None)
        if not steps:
            raise
        raise type(exc)(f"{name}{''.join(reversed(steps))}: {exc}") from None


def _step(exc: BadArgument, step: str) -> BadArgument:
    # Innermost step first; materialize_field writes them outermost first.
    steps = getattr(exc, "steps", None)
    if steps is None:
        steps = exc.steps = []  # type: ignore[attr-defined]
    steps.append(step)
    return exc


def _build_struct(
    value: PendingStruct, registry: TypeRegistry, resolve_ref: ResolveRef | None
) -> Any:
    cls = registry.lookup(value.name)
    if not dataclasses.is_dataclass(cls):
        raise BadArgument(f"{value.name:.200} is not a dataclass")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in value.fields if k not in fields]
    if unknown:
        raise BadArgument(f"{value.name:.200} has no field {short_repr(unknown[0])}")
    enums = registry.enum_fields(cls)
    kwargs = {}
    for name, raw in value.fields.items():
        if not fields[name].init:
            continue  # derived in __post_init__; the constructor recomputes it
        try:
            v = materialize(raw, registry, resolve_ref)
        except BadArgument as exc:
            raise _step(exc, f".{name}") from None
        if name in enums:
            v = coerce_atom(v, enums[name], f"{value.name}.{name}")
        kwargs[str(name)] = v
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise BadArgument(
            f"cannot build {value.name:.200} from its fields: {safe_str(exc):.500}"
        ) from None
