"""Type hints and default values as plain data, for the binding generator.

Every result is built from ``None``, bools, ints, floats, strs, lists and str-keyed dicts
only, so it travels over the bridge as plain msgpack and writes out as JSON unchanged.

**Types** (:func:`describe_type`) are dicts with a ``"kind"``:

========== ================================================ =========================
kind       Python                                           other keys
========== ================================================ =========================
any        ``Any``, no annotation, anything unrecognised
none       ``None``
bool/int   ``bool``, ``int``
float/str  ``float``, ``str``
bytes      ``bytes``, ``bytearray``
tensor     ``torch.Tensor``, ``numpy.ndarray`` (both travel
           as tensors)
list       ``list[T]``, ``Sequence[T]``, ...                ``item``
dict       ``dict[K, V]``, ``Mapping[K, V]``, ...           ``key``, ``value``
tuple      ``tuple[A, B]`` / ``tuple[T, ...]`` / ``tuple``  ``items`` / ``item``
union      ``A | B``, ``Optional[A]`` (flattened)           ``of``
dataclass  a dataclass that travels by value                ``class``
enum       an enum that travels by value                    ``class``, ``members``
ref        any other class (it travels as a reference)      ``class``
========== ================================================ =========================

A dataclass or enum travels by value when it is defined in a module of
``vllm_bridge.PUBLIC_MODULES`` (the worker's default allow-list) or of the allow-list of
the worker running this code (one's own modules, bound beside the library's), and is
reachable there by its qualified name, as the worker's type registry decides. The
bindings so assume a pool whose allow-list is the default one plus the bound modules
(the pool option ``modules:``).

**Values** (:func:`describe_value`, for defaults) are JSON-like: ``None``, bools, ints,
floats, strs and lists stand for themselves; everything else is a one-key-tagged dict:
``{"tuple": [...]}``, ``{"dict": [[k, v], ...]}``, ``{"enum": class, "member": name}``,
``{"dataclass": class, "fields": {...}}``, or ``{"repr": text}`` for a value with no data
form (a repr holding a memory address is replaced by the type name, so the output stays
deterministic).
"""

from __future__ import annotations

import collections
import collections.abc as abc
import dataclasses
import enum
import math
import re
import sys
import types
import typing
from typing import Any

import numpy as np
import torch

from vllm_bridge import PUBLIC_MODULES
from vllm_bridge.bridge.worker import allowlist

_LIST_ORIGINS = (
    list,
    abc.Sequence,
    abc.MutableSequence,
    abc.Collection,
    abc.Iterable,
    collections.deque,
)
_DICT_ORIGINS = (
    dict,
    abc.Mapping,
    abc.MutableMapping,
    collections.defaultdict,
    collections.OrderedDict,
)
_INT64 = (-(2**63), 2**64 - 1)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def qualified(cls: type) -> str:
    """``module.QualName`` of a class (bare name for builtins), as the wire spells it."""
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def by_value_modules() -> frozenset[str]:
    """The modules whose dataclasses and enums travel by value: the public ones and those
    of this worker's allow-list (just the public ones outside a worker)."""
    return frozenset(PUBLIC_MODULES).union(allowlist.current() or ())


def by_value(cls: Any) -> bool:
    """Whether instances of ``cls`` travel by value (ext 4 / ext 5) from a worker whose
    allow-list has its module (see the module docstring)."""
    if not isinstance(cls, type):
        return False
    if not (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
        return False
    if "<locals>" in cls.__qualname__ or cls.__module__ not in by_value_modules():
        return False
    obj: Any = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is cls


def describe_type(hint: Any) -> dict[str, Any]:
    """The plain-data form of a type hint (see the module docstring)."""
    if hint is None or hint is type(None):
        return {"kind": "none"}
    if hint is Any or isinstance(hint, (str, typing.TypeVar, typing.ForwardRef)):
        return {"kind": "any"}
    origin = typing.get_origin(hint)
    if origin is not None:
        return _describe_generic(hint, origin, typing.get_args(hint))
    if isinstance(hint, type):
        return _describe_class(hint)
    return {"kind": "any"}


def _describe_generic(hint: Any, origin: Any, args: tuple[Any, ...]) -> dict[str, Any]:
    if origin is typing.Union or origin is types.UnionType:
        return union([describe_type(a) for a in args])
    if origin is typing.Annotated:
        return describe_type(args[0])
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"kind": "tuple", "item": describe_type(args[0])}
        if args == ((),):  # tuple[()]
            return {"kind": "tuple", "items": []}
        return {"kind": "tuple", "items": [describe_type(a) for a in args]}
    if origin in _DICT_ORIGINS:
        key, value = args if len(args) == 2 else (Any, Any)
        return {"kind": "dict", "key": describe_type(key), "value": describe_type(value)}
    if origin in _LIST_ORIGINS:
        return {"kind": "list", "item": describe_type(args[0] if args else Any)}
    if isinstance(origin, type):
        return _describe_class(origin)
    return {"kind": "any"}


def _describe_class(cls: type) -> dict[str, Any]:
    if issubclass(cls, (torch.Tensor, np.ndarray)):
        return {"kind": "tensor"}
    if by_value(cls):
        if issubclass(cls, enum.Enum):
            return {"kind": "enum", "class": qualified(cls), "members": list(cls.__members__)}
        return {"kind": "dataclass", "class": qualified(cls)}
    if issubclass(cls, enum.Enum) or dataclasses.is_dataclass(cls):
        return {"kind": "ref", "class": qualified(cls)}
    # What the encoder sends for instances of the plain types and their subclasses.
    for base, kind in _PLAIN:
        if issubclass(cls, base):
            return dict(kind)
    return {"kind": "ref", "class": qualified(cls)}


_ANY = {"kind": "any"}
_PLAIN: tuple[tuple[type, dict[str, Any]], ...] = (
    (bool, {"kind": "bool"}),
    (int, {"kind": "int"}),
    (float, {"kind": "float"}),
    (str, {"kind": "str"}),
    (bytes, {"kind": "bytes"}),
    (bytearray, {"kind": "bytes"}),
    (dict, {"kind": "dict", "key": _ANY, "value": _ANY}),
    (list, {"kind": "list", "item": _ANY}),
    (tuple, {"kind": "tuple", "item": _ANY}),
)


def union(members: list[dict[str, Any]]) -> dict[str, Any]:
    """A union of type descriptions: nested unions flattened, duplicates dropped."""
    flat: list[dict[str, Any]] = []
    for m in members:
        for t in m["of"] if m["kind"] == "union" else [m]:
            if t not in flat:
                flat.append(t)
    if any(t["kind"] == "any" for t in flat):
        return {"kind": "any"}
    return flat[0] if len(flat) == 1 else {"kind": "union", "of": flat}


def yielded_type(hint: Any) -> dict[str, Any]:
    """What a generator annotated ``Iterator[X]`` / ``Generator[X, ...]`` yields: X."""
    origin = typing.get_origin(hint)
    if origin in (abc.Iterator, abc.Generator, abc.Iterable) and typing.get_args(hint):
        return describe_type(typing.get_args(hint)[0])
    return {"kind": "any"}


def describe_value(value: Any) -> Any:
    """The plain-data form of a value (see the module docstring)."""
    if value is None or isinstance(value, bool) or type(value) is str:
        return value
    if type(value) is int:
        return value if _INT64[0] <= value <= _INT64[1] else {"repr": repr(value)}
    if type(value) is float:
        return value if math.isfinite(value) else {"repr": repr(value)}
    if isinstance(value, enum.Enum) and by_value(type(value)):
        return {"enum": qualified(type(value)), "member": value.name}
    if dataclasses.is_dataclass(value) and by_value(type(value)):
        return {
            "dataclass": qualified(type(value)),
            "fields": {
                f.name: describe_value(getattr(value, f.name)) for f in dataclasses.fields(value)
            },
        }
    if type(value) is list:
        return [describe_value(v) for v in value]
    if type(value) is tuple:
        return {"tuple": [describe_value(v) for v in value]}
    if type(value) is dict:
        return {"dict": [[describe_value(k), describe_value(v)] for k, v in value.items()]}
    text = repr(value)
    if _ADDRESS.search(text):
        text = f"<{qualified(type(value))} object>"
    return {"repr": text}
