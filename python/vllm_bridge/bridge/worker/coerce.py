"""Arguments by annotation: an atom passed where a parameter is annotated with an enum
becomes that enum's member, named case-insensitively (``:full`` -> ``CUDAGraphMode.FULL``).
The ``self`` of a method defined in an enum's body (called as ``CUDAGraphMode.has_mode``)
counts as annotated with that enum.

Only :class:`~vllm_bridge.bridge.protocol.types.Atom` values are converted; everything else is
passed as it arrived. A call whose arguments hold no atom costs one scan of them.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import sys
from typing import Any

from vllm_bridge.bridge.protocol.registry import coerce_atom, enum_of_annotation, type_hints
from vllm_bridge.bridge.protocol.types import Atom

_Plan = tuple[inspect.Signature, dict[str, type[enum.Enum]]] | None
_plans: dict[Any, _Plan] = {}


def _key(fn: Any) -> Any:
    # A bound method is a new object on every access: key it by its function.
    func = getattr(fn, "__func__", None)
    return fn if func is None else (func, "bound")


def _plan(fn: Any) -> _Plan:
    """Signature and enum-annotated parameters of ``fn`` (cached per function)."""
    key = _key(fn)
    try:
        return _plans[key]
    except (KeyError, TypeError):
        pass
    plan: _Plan = None
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        if isinstance(fn, type):
            hints = type_hints(fn) if dataclasses.is_dataclass(fn) else type_hints(fn.__init__)
        else:
            hints = type_hints(fn)
        enums = {}
        for name in sig.parameters:
            target = enum_of_annotation(hints.get(name))
            if target is not None:
                enums[name] = target
        owner = _enum_owner(fn)
        first = next(iter(sig.parameters), None)
        if owner is not None and first is not None and first not in hints:
            enums[first] = owner
        plan = (sig, enums) if enums else None
    try:
        _plans[key] = plan
    except TypeError:
        pass  # unhashable callable: no cache
    return plan


def _enum_owner(fn: Any) -> type[enum.Enum] | None:
    """The enum whose body defines ``fn`` as a plain (instance) method, if any."""
    if not inspect.isfunction(fn):
        return None
    *owner_path, name = fn.__qualname__.split(".")
    if not owner_path or "<locals>" in owner_path:
        return None
    owner: Any = sys.modules.get(fn.__module__)
    for part in owner_path:
        owner = getattr(owner, part, None)
    if isinstance(owner, type) and issubclass(owner, enum.Enum) and vars(owner).get(name) is fn:
        return owner
    return None


def coerce_arguments(
    fn: Any, args: list[Any], kwargs: dict[str, Any], where: str
) -> tuple[list[Any], dict[str, Any]]:
    """``args`` and ``kwargs`` with atoms turned into enum members where ``fn``'s
    parameters are annotated with an enum.

    Raises:
        BadArgument: an atom names no member of the parameter's enum.
    """
    if not any(isinstance(a, Atom) for a in args) and not any(
        isinstance(v, Atom) for v in kwargs.values()
    ):
        return args, kwargs
    plan = _plan(fn)
    if plan is None:
        return args, kwargs
    sig, enums = plan
    try:
        bound = sig.bind_partial(*args, **kwargs)
    except TypeError:
        return args, kwargs  # the call itself reports the mismatch
    for name, value in bound.arguments.items():
        enum_cls = enums.get(name)
        if enum_cls is None:
            continue
        kind = sig.parameters[name].kind
        label = f"{where}: argument {name!r}"
        if kind is inspect.Parameter.VAR_POSITIONAL:
            bound.arguments[name] = tuple(coerce_atom(v, enum_cls, label) for v in value)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            bound.arguments[name] = {k: coerce_atom(v, enum_cls, label) for k, v in value.items()}
        else:
            bound.arguments[name] = coerce_atom(value, enum_cls, label)
    return list(bound.args), dict(bound.kwargs)
