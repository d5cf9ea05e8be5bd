"""What the binding generator (``mix vllm.gen.bindings``) reads of a Python module.

:func:`describe_module` returns plain data (see :mod:`vllm_bridge.bridge.introspect.hints` for
the type and value forms): the module's functions with their signatures, type hints,
defaults and docstrings, which of them are context managers, its module attributes (live
ones served by a module ``__getattr__`` included), its type aliases, and its dataclasses
(fields, defaults, methods) and enums (members, methods). Lists of named things are
sorted by name; parameters and fields keep their declaration order; so the same code
always gives the same output.

Which names of a module are described: what the module **exports**, plus the names the
caller asks for by ``also`` (vLLM's own bindings, the seeds, have three private names of
``vllm_bridge.forward_context``; the generator lists them):

* a module with ``__all__`` exports exactly the names listed there, including names it
  imports (``vllm_bridge.forward_context`` lists ``coordinate_batch_across_dp``);
* a module without ``__all__`` exports the public names (no leading underscore) it defines
  itself: its own functions and classes, the aliases and data attributes assigned or
  annotated at its top level (its source is read for that), and the live attributes its
  ``__getattr__`` serves. Imported names and private helpers are not exports.

Of those names:

* **functions** (and builtins) are described; never dunders;
* **dataclasses and enums** only where the module defines them (a re-exported class is
  bound with its own module; other classes are not bound: their instances travel by
  reference); their public methods (static and class methods, properties as their
  getters, context managers) are described with them;
* **type aliases** (``UBatchSlices = list[UBatchSlice]``) are callable (the alias's origin
  class);
* every other value but a module is a **data attribute**; *live* when ``dir(module)``
  lists it but the module's namespace lacks it (its ``__getattr__`` serves it). An
  attribute's type is its annotation in the module (an annotation-only declaration is
  enough), else that of its current value.

**Which modules can be described: those on the allow-list of the worker running this
code** (:mod:`vllm_bridge.bridge.worker.allowlist`, published by the worker at start;
outside a worker, ``vllm_bridge.PUBLIC_MODULES``). The binding generator starts its worker
with this module and the modules to bind allow-listed (``--allow``), so it can describe a
user's own module; any other name (``os``, a dotted path below an allow-listed module, a
name with characters no module name has) is refused before anything is imported, so a
worker that allow-lists this module does not become a way to import a module by name.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import enum
import importlib
import inspect
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from vllm_bridge import PUBLIC_MODULES
from vllm_bridge.bridge.introspect.hints import (
    by_value,
    describe_type,
    describe_value,
    qualified,
    yielded_type,
)
from vllm_bridge.bridge.protocol.registry import type_hints as _hints
from vllm_bridge.bridge.worker import allowlist

__all__ = ["FORMAT", "describable", "describe_module", "describe_function", "is_context_manager"]

#: Version of the output's layout; the generator refuses another.
FORMAT = 1

# Every @contextlib.contextmanager function is the same helper around a generator.
_CM_CODE = contextlib.contextmanager(lambda: (yield)).__code__

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional_only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
    inspect.Parameter.VAR_POSITIONAL: "var_positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    inspect.Parameter.VAR_KEYWORD: "var_keyword",
}


def describe_module(name: str, also: Sequence[str] = ()) -> dict[str, Any]:
    """Describe the module ``name``, one of this worker's allow-list: its exports and the
    names in ``also`` (see the module docstring).

    Raises:
        ValueError: ``name`` is not a dotted module name, or not on this worker's
            allow-list (:func:`describable`); a name of ``also`` or of the module's
            ``__all__`` is not an attribute of the module, or is a dunder; a name of
            ``also`` is not a Python identifier, or its value is a module (``also``
            adds names of the module; another module is described only by its own
            name, which must be on the allow-list).
        TypeError: ``name`` is not a str, ``also`` not a list or tuple of str, or the
            module's ``__all__`` not a list or tuple of str.
        Exception: what importing the module raises (``ModuleNotFoundError``, or the
            module's own error), unchanged.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a module name (str), got {name!r}")
    _check_names("also", also)
    for attr in also:
        if not attr.isidentifier():
            raise ValueError(f"{attr!r:.200} (of also) is not a Python identifier")
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"{name!r:.200} is not a dotted module name")
    allowed = describable()
    if name not in allowed:
        raise ValueError(
            f"{name!r} is not on this worker's allow-list, so it cannot be described; "
            f"describable: {', '.join(allowed)}"
        )
    module = importlib.import_module(name)
    assigned = _assigned_names(module)
    hints = _hints(module)
    namespace = vars(module)
    live = set(dir(module)) - set(namespace)
    if "__all__" in namespace:
        _check_names(f"{name}.__all__", namespace["__all__"])
        exported = set(namespace["__all__"])
    else:
        exported = _defined_names(module, namespace, live, assigned | set(hints))
    wanted = exported | set(also)
    for attr in sorted(wanted):
        if attr.startswith("__") or not hasattr(module, attr):
            where = "also" if attr in also else f"{name}.__all__"
            raise ValueError(f"{attr!r} (of {where}) is not a bindable attribute of {name}")
    for attr in sorted(also):
        value = getattr(module, attr)
        if isinstance(value, types.ModuleType):
            raise ValueError(
                f"{attr!r} (of also) is the module {value.__name__}, not an attribute "
                f"{name} defines; only the modules of the allow-list are described"
            )

    functions, classes, aliases, attributes = [], [], [], []
    for attr in sorted(wanted):
        value = getattr(module, attr)
        if _is_alias(value):
            aliases.append(_describe_alias(attr, value))
        elif isinstance(value, type):
            if _defines(module, value, attr):
                described = _describe_class(value)
                if described is not None:
                    classes.append(described)
        elif _is_function(value):
            functions.append(describe_function(value, attr, attr))
        elif not isinstance(value, types.ModuleType):
            attributes.append(_describe_attribute(attr, value, hints, attr in live))

    return {
        "format": FORMAT,
        "module": name,
        "doc": _doc(module),
        "functions": functions,
        "classes": classes,
        "aliases": aliases,
        "attributes": attributes,
    }


def describable() -> tuple[str, ...]:
    """The modules :func:`describe_module` describes: the allow-list of the worker running
    this code, or ``vllm_bridge.PUBLIC_MODULES`` outside a worker."""
    published = allowlist.current()
    return PUBLIC_MODULES if published is None else published


def _check_names(what: str, names: Any) -> None:
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what} must be a list or tuple of names (str), got {names!r}")


def _defines(module: types.ModuleType, cls: type, attr: str) -> bool:
    return cls.__module__ == module.__name__ and cls.__qualname__ == attr


def _defined_names(
    module: types.ModuleType, namespace: dict[str, Any], live: set[str], declared: set[str]
) -> set[str]:
    """The exports of a module without ``__all__``: the public names it defines itself."""
    names = set()
    for attr in set(namespace) | live:
        if attr.startswith("_"):
            continue
        value = getattr(module, attr)
        if isinstance(value, types.ModuleType):
            continue
        if not _is_alias(value) and (isinstance(value, type) or _is_function(value)):
            mine = getattr(value, "__module__", None) == module.__name__
        else:
            mine = attr in live or attr in declared
        if mine:
            names.add(attr)
    return names


def is_context_manager(fn: Any) -> bool:
    """Whether ``fn`` is a ``@contextlib.contextmanager`` function (or method)."""
    return getattr(fn, "__code__", None) is _CM_CODE


def describe_function(
    fn: Callable[..., Any], name: str, path: str, owner: type | None = None, kind: str = "function"
) -> dict[str, Any]:
    """One callable: ``path`` is its attribute path in the module; ``owner`` the class whose
    instance method it is (its first parameter is then typed as that class)."""
    cm = is_context_manager(fn)
    target = inspect.unwrap(fn) if cm else fn
    hints = _hints(target)
    sig = inspect.signature(fn)
    params = []
    for i, p in enumerate(sig.parameters.values()):
        if owner is not None and i == 0:
            ptype = describe_type(owner)
        else:
            ptype = describe_type(hints.get(p.name, Any))
        param = {"name": p.name, "kind": _KINDS[p.kind], "type": ptype}
        if p.default is not inspect.Parameter.empty:
            param["default"] = describe_value(p.default)
        params.append(param)
    returns = hints.get("return", Any)
    out = {
        "name": name,
        "path": path,
        "kind": kind,
        "defined_in": getattr(fn, "__module__", None),
        "doc": _doc(fn),
        "context_manager": cm,
        "params": params,
        "returns": describe_type(returns),
    }
    if cm:
        out["yields"] = yielded_type(returns)
    return out


# -- classes --------------------------------------------------------------------------------


def _describe_class(cls: type) -> dict[str, Any] | None:
    if not by_value(cls):
        return None
    if issubclass(cls, enum.Enum):
        return {
            "name": cls.__name__,
            "class": qualified(cls),
            "kind": "enum",
            "doc": _doc(cls),
            "members": [
                {"name": m, "value": describe_value(v.value)} for m, v in cls.__members__.items()
            ],
            "methods": _methods(cls),
        }
    hints = _hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        field = {"name": f.name, "type": describe_type(hints.get(f.name, Any)), "init": f.init}
        if f.default is not dataclasses.MISSING:
            field["default"] = describe_value(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            field["default"] = describe_value(f.default_factory())
            field["default_factory"] = True
        fields.append(field)
    return {
        "name": cls.__name__,
        "class": qualified(cls),
        "kind": "dataclass",
        "doc": _doc(cls),
        "frozen": cls.__dataclass_params__.frozen,
        "fields": fields,
        "methods": _methods(cls),
    }


def _methods(cls: type) -> list[dict[str, Any]]:
    """Methods defined in the class body itself (not inherited), properties as getters."""
    out = []
    for name, raw in sorted(vars(cls).items()):
        if name.startswith("_"):
            continue
        path = f"{cls.__qualname__}.{name}"
        if isinstance(raw, staticmethod):
            out.append(describe_function(raw.__func__, name, path, kind="staticmethod"))
        elif isinstance(raw, classmethod):
            out.append(describe_function(getattr(cls, name), name, path, kind="classmethod"))
        elif isinstance(raw, property) and raw.fget is not None:
            out.append(describe_function(raw.fget, name, f"{path}.fget", cls, kind="property"))
        elif isinstance(raw, types.FunctionType):
            out.append(describe_function(raw, name, path, cls, kind="method"))
    return out


# -- aliases and attributes -----------------------------------------------------------------


def _is_alias(value: Any) -> bool:
    return isinstance(value, types.GenericAlias) or (
        type(value).__module__ == "typing" and typing.get_origin(value) is not None
    )


def _describe_alias(name: str, alias: Any) -> dict[str, Any]:
    """A type alias, callable as its origin class: ``UBatchSlices(items)`` is ``list(items)``.
    Positional parameters of the origin's constructor take the alias's type."""
    origin = typing.get_origin(alias)
    alias_type = describe_type(alias)
    try:
        signature = inspect.signature(origin)
    except (TypeError, ValueError):
        signature = inspect.Signature()
    params = []
    for p in signature.parameters.values():
        positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        param = {
            "name": p.name,
            "kind": _KINDS[p.kind],
            "type": alias_type if positional else {"kind": "any"},
        }
        if p.default is not inspect.Parameter.empty:
            param["default"] = describe_value(p.default)
        params.append(param)
    return {
        "name": name,
        "path": name,
        "kind": "alias",
        "defined_in": None,
        "doc": _doc(origin),
        "context_manager": False,
        "params": params,
        "returns": alias_type,
    }


def _describe_attribute(
    name: str, value: Any, hints: dict[str, Any], live: bool
) -> dict[str, Any]:
    if name in hints:
        described = describe_type(hints[name])
    elif value is None:
        described = {"kind": "any"}
    else:
        described = describe_type(type(value))
    return {"name": name, "type": described, "live": live}


# -- helpers --------------------------------------------------------------------------------


def _is_function(value: Any) -> bool:
    return isinstance(value, (types.FunctionType, types.BuiltinFunctionType))


def _doc(obj: Any) -> str | None:
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def _assigned_names(module: types.ModuleType) -> set[str]:
    """Names bound by assignments at the top level of the module's source."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return set()
    names: set[str] = set()
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Name):
                    names.add(sub.id)
    return names
