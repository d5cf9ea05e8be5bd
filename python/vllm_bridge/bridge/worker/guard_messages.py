"""What the value guard's refusals say (:mod:`~vllm_bridge.bridge.worker.guard`): what a
refused value is, named without calling its ``repr``, and where it sits in a reply."""

from __future__ import annotations

import types
from typing import Any

from vllm_bridge.bridge.protocol import paths
from vllm_bridge.bridge.worker.guard_tables import METHOD_KINDS


def describe(value: Any) -> str:
    """What ``value`` is, for messages, without calling its ``repr``."""
    if isinstance(value, types.ModuleType):
        return f"the module {getattr(value, '__name__', '?')!r}"
    if isinstance(value, type):
        return f"the class {qualified(value)}"
    name = getattr(value, "__name__", "?")
    if isinstance(value, types.FunctionType):
        return f"the function {value.__module__}.{value.__qualname__}"
    if isinstance(value, types.BuiltinFunctionType):
        owner = value.__self__
        if owner is None or isinstance(owner, types.ModuleType):
            home = owner.__name__ if owner is not None else value.__module__
            name = getattr(value, "__qualname__", name)
            return f"the builtin {home}.{name}" if isinstance(home, str) else f"the builtin {name}"
        cls = owner if isinstance(owner, type) else type(owner)
        return f"the method {qualified(cls)}.{name}"
    if isinstance(value, types.MethodType):
        owner = value.__self__
        cls = owner if isinstance(owner, type) else type(owner)
        return f"the method {qualified(cls)}.{name}"
    if isinstance(value, METHOD_KINDS):
        owner = getattr(value, "__objclass__", None) or type(getattr(value, "__self__", None))
        return f"the method {qualified(owner)}.{name}"
    return f"a {qualified(type(value))} object"


def qualified(cls: type) -> str:
    """``module.QualName`` of ``cls``, read without calling anything of it."""
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', '?')}"


def spot(root: Any, target: Any, where: str) -> str:
    """``where`` (a reply) completed with where ``target`` sits inside ``root``."""
    path = locate(root, target)
    if path is None:
        return f"a value inside {where}"
    return f"{where} (at {path})" if path else where


def locate(root: Any, target: Any, limit: int = 10_000) -> str | None:
    """Where ``target`` sits inside ``root`` as the encoder walks it (list and tuple items,
    dict keys and values, dataclass fields): ``"[2]['model'].weight"``, ``""`` for
    ``root`` itself, or ``None`` when it is not found within ``limit`` values."""
    found = paths.find(root, lambda value: value is target, limit)
    return None if found is None else found[1]
