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
import types
import weakref
from typing import Any

from vllm_bridge.bridge.protocol.registry import coerce_atom, enum_of_annotation, type_hints
from vllm_bridge.bridge.protocol.types import Atom

_Plan = tuple[inspect.Signature, dict[str, type[enum.Enum]]] | None

# C functions and slot wrappers carry no annotations, so no plan; nor are they cached: a
# bound one (``gen.send``, ``tensor.add``) is a new object per access, holding its self.
# By id: ``type(fn)`` may be a class whose metaclass overrides __eq__ and __hash__.
_NO_PLAN = frozenset(
    id(t)
    for t in (
        types.BuiltinFunctionType,
        types.MethodWrapperType,
        types.WrapperDescriptorType,
        types.MethodDescriptorType,
        types.ClassMethodDescriptorType,
    )
)
_PLANS_MAX = 256


class _Entry(weakref.ref):
    """A cached plan, referring weakly to the callable it was made for."""

    __slots__ = ("key", "plan")


class _Plans(dict[int, _Entry]):
    """Plans by the ``id`` of the callable each was made for: never by the callable, whose
    own __hash__ and __eq__ would decide the lookup and which a key would keep alive. The
    entry's referent, compared with ``is``, tells a live callable from a dead one whose id
    was reused; a callable's death drops its plan (a signature holds its defaults), and
    past _PLANS_MAX the oldest goes, so fresh callables (a closure per call) cannot pile up.
    """

    def keep(self, owner: Any, plan: _Plan) -> None:
        try:
            entry = _Entry(owner, self._forget)
        except TypeError:
            return  # no weak reference to it: its plan is made anew on each call
        entry.key, entry.plan = id(owner), plan
        self[entry.key] = entry
        while len(self) > _PLANS_MAX:
            try:
                del self[next(iter(self))]
            except (KeyError, RuntimeError, StopIteration):
                break  # another thread changed it meanwhile

    def _forget(self, entry: _Entry) -> None:
        if self.get(entry.key) is entry:
            self.pop(entry.key, None)


_plans = _Plans()
_bound_plans = _Plans()  # a bound method's plan, by its function


def _plan(fn: Any) -> _Plan:
    """Signature and enum-annotated parameters of ``fn``, ``None`` when it has none
    (cached per function)."""
    t = type(fn)
    # A bound method is a new object on every access; its signature is its function's.
    if t is types.MethodType:
        owner, plans = fn.__func__, _bound_plans
    else:
        owner, plans = fn, _plans
    entry = plans.get(id(owner))
    if entry is not None and entry() is owner:
        return entry.plan
    if id(t) in _NO_PLAN:
        return None
    plan = _make_plan(fn)
    plans.keep(owner, plan)
    return plan


def _make_plan(fn: Any) -> _Plan:
    """:func:`_plan`, not cached."""
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
