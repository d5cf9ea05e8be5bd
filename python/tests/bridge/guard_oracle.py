"""The security tests' oracle of the value guard and its call rule, built apart from the
guard's tables (python/vllm_bridge/bridge/worker/guard_tables.py).

Every callable and class that the capability modules *define* (os, subprocess, sys, gc,
inspect, importlib, pickle, io, threading, functools, operator, logging, ...), the
evaluating builtins named by hand, and the worker's own classes: what no caller may
reach (:data:`CAPABILITIES`, :data:`WORKER_CLASSES`). :func:`reachable` walks every
attribute path the guard lets through; :func:`call_oracle` is the tests' own judgement
of what is safe to call (where the code's source file is, which methods wrap a
capability). Used by test_security_guard.py and test_security_call_rule.py.
"""

from __future__ import annotations

import _io
import _thread
import code
import codeop
import copyreg
import ctypes
import dataclasses
import functools
import gc
import importlib
import importlib.util
import inspect
import io
import logging
import marshal
import operator
import os
import pathlib
import pickle
import posix
import runpy
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import types
import typing
import warnings
import weakref
import zipimport
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import vllm_bridge
from vllm_bridge.bridge.protocol.registry import TypeRegistry
from vllm_bridge.bridge.worker import channel, dispatch, executor, guard_tables, server, sessions
from vllm_bridge.bridge.worker.guard import Guard
from vllm_bridge.bridge.worker.targets import TargetResolver

CAPABILITY_MODULES = (
    os, posix, subprocess, sys, gc, inspect, importlib, importlib.util, pickle, marshal,
    ctypes, shutil, socket, io, _io, threading, _thread, signal, tempfile, pathlib, runpy,
    code, codeop, zipimport, functools, operator, logging, weakref, copyreg, string,
    typing, dataclasses, warnings,
)  # fmt: skip

EVALUATING_BUILTINS = (
    eval, exec, compile, __import__, open, getattr, setattr, delattr, hasattr, vars,
    globals, locals, dir, breakpoint, input, type,
)  # fmt: skip

ORDINARY_BUILTINS = (
    len, sorted, min, max, sum, abs, round, isinstance, issubclass, iter, next, repr,
    hash, id, print, callable, any, all, divmod, pow, chr, ord, range, list, dict, tuple,
    set, frozenset, str, int, float, bool, bytes, enumerate, zip, map, filter, reversed,
    object, property, classmethod, ValueError, slice,
)  # fmt: skip

WORKER_CLASSES = (
    TargetResolver, TypeRegistry, Guard, sessions.Sessions, sessions.Session,
    dispatch.Dispatcher, channel.Channel, channel.LogFrameHandler, executor.Executor,
    server.Worker,
)  # fmt: skip


def _defined_in(module: types.ModuleType, value: Any) -> bool:
    owner = getattr(value, "__self__", None)
    if isinstance(value, types.BuiltinFunctionType) and isinstance(owner, types.ModuleType):
        return owner is module
    return getattr(value, "__module__", None) == module.__name__


#: What the forward-context API hands out on purpose (``init_logger``, ``logger``): a
#: logger may be held, and may log; test_loggers_may_log_but_not_be_rewired says how far.
HANDED_OUT = (logging.Logger, logging.RootLogger)


def capabilities() -> list[tuple[str, Any]]:
    """Every callable and class the capability modules define, and the evaluating
    builtins: what no caller may reach."""
    found = [(f"builtins.{f.__name__}", f) for f in EVALUATING_BUILTINS]
    for module in CAPABILITY_MODULES:
        for name, value in sorted(vars(module).items()):
            if (
                not name.startswith("__")
                and callable(value)
                and _defined_in(module, value)
                and value not in HANDED_OUT
            ):
                found.append((f"{module.__name__}.{name}", value))
    return found


CAPABILITIES = capabilities()
#: The allow-list of these tests: the default one, the demo's runner (off the default
#: list; the demo's pools allow it) and the careless user module.
ALLOWED = frozenset([*vllm_bridge.PUBLIC_MODULES, "vllm_bridge.demo.rank", "security_probe"])


def reachable(guard: Guard, roots: Iterable[tuple[str, Any]], depth: int) -> dict[int, Any]:
    """Every object the guard lets a caller reach from ``roots`` by attribute paths of at
    most ``depth`` steps (as TargetResolver.walk: getattr, then the check): id ->
    (path, object)."""
    seen: dict[int, tuple[str, Any]] = {}
    frontier = list(roots)
    for _ in range(depth + 1):
        following = []
        for path, obj in frontier:
            if id(obj) in seen or guard.reason(obj) is not None:
                continue
            seen[id(obj)] = (path, obj)
            try:
                names = dir(obj)
                if isinstance(obj, type):  # what a class's metaclass gives it (Enum._convert_)
                    names = sorted({*names, *dir(type(obj))})
            except Exception:
                continue
            for name in names:
                if name.startswith("__"):
                    continue
                try:
                    value = getattr(obj, name)
                except Exception:
                    continue
                following.append((f"{path}.{name}", value))
        frontier = following
    return seen


# -- what is safe to call ---------------------------------------------------------------

ALLOWED_FILES = frozenset(
    str(Path(importlib.import_module(name).__file__).resolve()) for name in ALLOWED
)

#: Value types whose public methods are ordinary computations on the value.
VALUE_TYPES = (
    torch.Tensor, torch.nn.Module, np.ndarray, list, dict, set, frozenset, tuple, str, bytes,
    bytearray, int, float, complex, types.GeneratorType, types.CoroutineType, logging.Logger,
)  # fmt: skip

#: Methods of those types that wrap a capability or install code (written here, apart from
#: guard_tables): compile, storage and shared memory, hooks, callbacks, writers, formatting
#: that walks attributes, a logger's rewiring.
CAPABILITY_METHODS = frozenset({
    "compile", "share_memory", "share_memory_", "storage", "untyped_storage", "storage_type",
    "set_", "data_ptr", "const_data_ptr", "apply_", "map_", "map2_", "as_subclass",
    "add_module", "set_submodule", "to_empty", "tofile", "dump", "dumps", "format",
    "format_map", "addFilter", "removeFilter", "addHandler", "removeHandler", "setLevel",
    "handle", "callHandlers", "makeRecord", "findCaller", "filter",
})  # fmt: skip


def _code_file(fn: Any) -> str | None:
    while getattr(fn, "__wrapped__", None) is not None:  # lru_cache, @contextmanager
        fn = fn.__wrapped__
    code = getattr(fn, "__code__", None)
    return str(Path(code.co_filename).resolve()) if code is not None else None


def _value_method(owner: Any, name: Any) -> bool:
    cls = owner if isinstance(owner, type) else type(owner)
    return (
        isinstance(name, str)
        and issubclass(cls, VALUE_TYPES)
        and not name.startswith("_")
        and not name.startswith("register_")
        and name not in CAPABILITY_METHODS
    )


def call_oracle(fn: Any) -> bool:  # noqa: C901 - one branch per kind
    """The test's own judgement of whether calling ``fn`` is safe: its source is in an
    allow-listed module's file, or it is an ordinary method of a value type."""
    if isinstance(fn, functools.partial):
        return call_oracle(fn.func)
    if isinstance(fn, staticmethod):
        return call_oracle(fn.__func__)
    if isinstance(fn, types.GenericAlias):
        return call_oracle(fn.__origin__)
    if isinstance(fn, types.MethodType):
        return _code_file(fn.__func__) in ALLOWED_FILES or _value_method(
            fn.__self__, fn.__func__.__name__
        )
    if isinstance(fn, types.BuiltinFunctionType):
        owner = fn.__self__
        if owner is None or isinstance(owner, types.ModuleType):
            return getattr(owner, "__name__", None) in ALLOWED
        return _value_method(owner, fn.__name__)
    if isinstance(fn, guard_tables.METHOD_KINDS):  # unbound: str.upper, torch.Tensor.sum
        owner = getattr(fn, "__objclass__", None)
        return _value_method(owner, fn.__name__) or any(
            getattr(cls, fn.__name__, None) is fn and _value_method(cls, fn.__name__)
            for cls in VALUE_TYPES
        )
    if isinstance(fn, type):
        if fn in (list, dict, set, frozenset, tuple, str, bytes, bytearray, int, float,
                  complex, bool):
            return True
        defined = sys.modules.get(fn.__module__)
        for part in fn.__qualname__.split("."):
            defined = getattr(defined, part, None)
        return defined is fn and fn.__module__ in ALLOWED
    if _code_file(fn) is not None:
        return _code_file(fn) in ALLOWED_FILES
    call = type(fn).__call__
    if isinstance(fn, torch.nn.Module):
        return call is torch.nn.Module.__call__ or _code_file(call) in ALLOWED_FILES
    return _code_file(call) in ALLOWED_FILES and call_oracle(type(fn))

