"""Which classes travel by value, and how an Elixir atom becomes an enum member.

A class is *registered* when it is a dataclass or an :class:`enum.Enum` defined in an
allow-listed module and reachable there by its qualified name (so the decoder can find it
again). Registered dataclasses travel as ext 4 and registered enum members as ext 5; the
decoder constructs registered classes only and refuses any other name.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import sys
import types
import typing
from collections.abc import Iterable
from typing import Any

from vllm_bridge.bridge.protocol.errors import BadArgument, short_repr
from vllm_bridge.bridge.protocol.types import Atom, qualified_name


class TypeRegistry:
    """Registered classes of a set of allow-listed modules."""

    def __init__(self, modules: Iterable[str]) -> None:
        self.modules: frozenset[str] = frozenset(modules)
        self._by_class: dict[type, str | None] = {}
        self._by_name: dict[str, type] = {}
        self._enum_fields: dict[type, dict[str, type[enum.Enum]]] = {}

    # -- encoding side -------------------------------------------------------------------

    def name_of(self, cls: type) -> str | None:
        """The wire name of ``cls`` when it is registered, else ``None``."""
        try:
            return self._by_class[cls]
        except KeyError:
            pass
        name: str | None = None
        module = sys.modules.get(cls.__module__)
        if cls.__module__ in self.modules and module is not None and _is_value_class(cls):
            if _walk(module, cls.__qualname__) is cls:
                name = qualified_name(cls)
                self._by_name[name] = cls
        self._by_class[cls] = name
        return name

    # -- decoding side -------------------------------------------------------------------

    def lookup(self, name: str) -> type:
        """The registered class called ``name`` (``module.QualName``).

        Raises:
            BadArgument: no allow-listed module defines a dataclass or enum of that name.
        """
        cls = self._by_name.get(name)
        if cls is not None:
            return cls
        for module_name in sorted(self.modules, key=len, reverse=True):
            if not name.startswith(module_name + "."):
                continue
            try:
                module = importlib.import_module(module_name)
            except Exception:
                continue
            candidate = _walk(module, name[len(module_name) + 1 :])
            if isinstance(candidate, type) and self.name_of(candidate) == name:
                return candidate
        raise BadArgument(
            f"unknown class {short_repr(name)}: not a dataclass or enum defined in an allow-listed "
            "module"
        )

    def enum_fields(self, cls: type) -> dict[str, type[enum.Enum]]:
        """Fields of dataclass ``cls`` annotated with an enum type (``E`` or ``E | None``)."""
        try:
            return self._enum_fields[cls]
        except KeyError:
            pass
        hints = type_hints(cls)
        result = {}
        for f in dataclasses.fields(cls):
            target = enum_of_annotation(hints.get(f.name))
            if target is not None:
                result[f.name] = target
        self._enum_fields[cls] = result
        return result


def _is_value_class(cls: type) -> bool:
    return (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)) and (
        "<locals>" not in cls.__qualname__
    )


def _walk(root: Any, qualname: str) -> Any:
    # A class is reachable by its qualified name inside its own module, never through
    # another module: stopping at one keeps a wire name such as
    # "vllm_bridge.dp.torch._dynamo.X" from importing anything (a lazy module's
    # __getattr__ would).
    obj = root
    for part in qualname.split("."):
        if not part or part.startswith("__"):
            return None
        if obj is not root and isinstance(obj, types.ModuleType):
            return None
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def type_hints(obj: Any) -> dict[str, Any]:
    """``typing.get_type_hints(obj)``, or ``{}`` when the annotations cannot be evaluated."""
    try:
        return typing.get_type_hints(obj)
    except Exception:
        return {}


def enum_of_annotation(annotation: Any) -> type[enum.Enum] | None:
    """The enum class an annotation names: ``E``, ``E | None`` or ``Optional[E]``."""
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        enums = [a for a in typing.get_args(annotation) if enum_of_annotation(a) is not None]
        if len(enums) == 1:
            return enums[0]
    return None


def coerce_atom(value: Any, enum_cls: type[enum.Enum], where: str) -> Any:
    """``value`` as a member of ``enum_cls`` when it is an :class:`Atom`, else unchanged.

    The atom names the member case-insensitively (``:full`` -> ``CUDAGraphMode.FULL``).

    Raises:
        BadArgument: the atom names no member; the message names ``where`` and the atom.
    """
    if not isinstance(value, Atom):
        return value
    member = enum_cls.__members__.get(value) or enum_cls.__members__.get(value.upper())
    if member is None:
        folded = value.casefold()
        for name, candidate in enum_cls.__members__.items():
            if name.casefold() == folded:
                member = candidate
                break
    if member is None:
        names = ", ".join(enum_cls.__members__)
        raise BadArgument(
            f"{where}: :{value:.80} is not a member of {qualified_name(enum_cls)} ({names:.400})"
        )
    return member
