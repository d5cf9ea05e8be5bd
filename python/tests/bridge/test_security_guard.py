"""The value guard and its call rule on their own (python/vllm_bridge/bridge/worker/guard.py,
guard_calls.py), in this process.

The oracle is built apart from the guard's tables: every callable and class that the
capability modules *define* (os, subprocess, sys, gc, inspect, importlib, pickle, io,
threading, functools, operator, logging, ...), the evaluating builtins named by hand, and
the worker's own classes. A breadth-first walk over every attribute path the guard lets
through, from each allow-listed module and from objects calls hand back, must meet none
of them; and of everything callable it meets, the call rule may admit only what the
test's own judgement (:func:`call_oracle`: where the code's source file is, which methods
wrap a capability) says is safe to call. Ordinary values must pass, and the cached fast
paths must agree with the uncached verdicts.
"""

from __future__ import annotations

import _io
import _thread
import builtins
import code
import codeop
import collections
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
import pytest
import security_probe
import torch

import vllm_bridge
from vllm_bridge.bridge import diag
from vllm_bridge.bridge.protocol.errors import BadArgument
from vllm_bridge.bridge.protocol.messages import ModuleTarget
from vllm_bridge.bridge.protocol.registry import TypeRegistry
from vllm_bridge.bridge.worker import channel, dispatch, executor, guard_tables, server, sessions
from vllm_bridge.bridge.worker.guard import Guard
from vllm_bridge.bridge.worker.guard_calls import CallRule
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
ALLOWED = frozenset([*vllm_bridge.PUBLIC_MODULES, "security_probe"])


@pytest.fixture(scope="module")
def guard() -> Guard:
    return Guard(ALLOWED)


def test_the_oracle_is_large() -> None:
    assert len(CAPABILITIES) > 800


@pytest.mark.parametrize("module", CAPABILITY_MODULES, ids=lambda m: m.__name__)
def test_everything_a_capability_module_defines_is_refused(guard: Guard, module: Any) -> None:
    mine = [(n, v) for n, v in CAPABILITIES if n.rsplit(".", 1)[0] == module.__name__]
    assert mine, module
    passed = [name for name, value in mine if guard.reason(value) is None]
    assert passed == []
    assert guard.reason(module) is not None


def test_evaluating_builtins_are_refused_and_ordinary_ones_pass(guard: Guard) -> None:
    assert [f for f in EVALUATING_BUILTINS if guard.reason(f) is None] == []
    assert [f for f in ORDINARY_BUILTINS if guard.reason(f) is not None] == []


def test_interpreter_objects_are_refused(guard: Guard) -> None:
    def gen() -> Any:
        yield 1

    g = gen()
    x = 1
    cell = (lambda: x).__closure__[0]  # type: ignore[index]
    try:
        raise ValueError("tb")
    except ValueError as exc:
        tb = exc.__traceback__
    for value in (g.gi_frame, g.gi_code, tb, cell, sys._getframe(), vars(builtins),
                  vars(os), sys.modules, sys.path, logging.getLogger().handlers):
        assert guard.reason(value) is not None, value
    assert guard.reason(g) is None  # the generator itself is usable


def test_wrappers_are_judged_by_what_they_wrap(guard: Guard) -> None:
    assert guard.reason(functools.partial(os.system, "true")) is not None
    assert guard.reason(functools.partial(diag.add, 1)) is None
    assert guard.reason(functools.partial(diag.add, eval)) is not None  # what it holds
    assert guard.reason(functools.lru_cache(os.getpid)) is not None
    assert guard.reason(security_probe.square) is None
    assert guard.reason(staticmethod(os.system)) is not None
    assert guard.reason(staticmethod(diag.add)) is None


def test_loggers_may_log_but_not_be_rewired(guard: Guard) -> None:
    logger = logging.getLogger("security.test")
    for ordinary in (logger, logger.info, logger.warning, logger.log, logger.getChild("c"),
                     logger.isEnabledFor, logger.root, logger.root.error):
        assert guard.reason(ordinary) is None, ordinary
    for refused in (logger.addHandler, logger.removeHandler, logger.setLevel,
                    logger.addFilter, logger.findCaller, logger.makeRecord, logger.manager,
                    logger.root.handlers, logger.root.setLevel, logging.Logger.info,
                    logging.getLogger, logging.Handler(), logging.LogRecord(
                        "n", 10, "p", 1, "m", None, None)):
        assert guard.reason(refused) == guard_tables.WORKER, refused


def test_methods_are_judged_by_their_owner(guard: Guard) -> None:
    assert guard.reason(logging.getLogger("x").addHandler) is not None  # a logger's
    assert guard.reason(sys.stderr.write) is not None  # an open file's
    assert guard.reason("{}".format) is not None and guard.reason(str.format) is not None
    assert guard.reason(np.zeros(2).tofile) is not None
    assert guard.reason(torch.zeros(2).untyped_storage().from_file) is not None
    assert guard.reason((1).__add__) is not None  # dunders, also as values
    for ordinary in ([].append, {}.get, "a".upper, torch.zeros(2).sum, np.zeros(2).sum,
                     diag.Opaque().bump, torch.nn.Linear(1, 1).forward, dict.fromkeys,
                     diag.Level.HIGH.name.upper):
        assert guard.reason(ordinary) is None, ordinary


def test_ordinary_values_pass(guard: Guard) -> None:
    values = [None, 1, 1.5, "s", b"b", [1], {"a": 1}, (1,), torch.zeros(2), np.float64(1),
              np.zeros(2), diag.Sample("x"), diag.Level.HIGH, diag.Opaque(), diag, diag.add,
              diag.Opaque, torch.nn.Linear(1, 1), torch.Generator(), torch.float32,
              torch.nn.functional.linear, torch.relu, ValueError("x"), collections.OrderedDict(),
              security_probe.Holder(), security_probe.PARTIAL_ADD]  # fmt: skip
    assert [v for v in values if guard.reason(v) is not None] == []


def test_the_allow_list_is_exact(guard: Guard) -> None:
    assert guard.reason(diag) is None
    assert guard.reason(vllm_bridge) is not None  # the package is not allow-listed
    stale = types.ModuleType("vllm_bridge.bridge.diag")  # an impostor of the same name
    assert guard.reason(stale) is not None


def test_a_module_imported_afresh_leaves_the_old_object_outside() -> None:
    name = "security_guard_fresh"
    first = types.ModuleType(name)
    sys.modules[name] = first
    try:
        guard = Guard(frozenset({name}))
        for _ in range(2):  # judged twice: no cached verdict outlives sys.modules
            assert guard.check(first, "x") is first
        second = sys.modules[name] = types.ModuleType(name)
        assert guard.reason(first) is not None and guard.reason(second) is None
    finally:
        sys.modules.pop(name, None)


def test_a_capability_imported_later_is_refused_from_then_on() -> None:
    """The tables name objects by module; a module imported after the guard has looked
    is looked up as soon as it is there (here the class BASES names in
    ``multiprocessing.process``, imported afresh)."""
    import multiprocessing

    name = "multiprocessing.process"
    saved_module, saved_attr = sys.modules.pop(name), multiprocessing.process
    try:
        guard = Guard(ALLOWED)
        assert guard.reason(diag.add) is None  # looked at sys.modules without it
        fresh = importlib.import_module(name)
        assert fresh is not saved_module

        class Spawner(fresh.BaseProcess):  # type: ignore[name-defined, misc]
            pass

        assert guard.reason(Spawner) == guard_tables.OS_ACCESS
    finally:
        sys.modules[name] = saved_module
        multiprocessing.process = saved_attr  # type: ignore[attr-defined]


# -- the reachable graph ------------------------------------------------------------------


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


def test_no_capability_or_worker_state_is_reachable(guard: Guard) -> None:
    roots = [(name, importlib.import_module(name)) for name in sorted(ALLOWED)]
    roots += [
        ("<generator>", diag.count(2)),
        ("<holder>", security_probe.Holder()),
        ("<model>", security_probe.make_model()),
        ("<exception>", security_probe.caught()),
        ("<object array>", security_probe.object_array()),
        ("<recorder>", diag.recorder("r")),
    ]
    seen = reachable(guard, roots, depth=3)
    assert len(seen) > 2000  # the walk went somewhere
    forbidden = {id(v): n for n, v in CAPABILITIES}
    hits = [f"{path} is {forbidden[i]}" for i, (path, _) in seen.items() if i in forbidden]
    assert hits == []
    for path, obj in seen.values():
        assert not isinstance(obj, WORKER_CLASSES), path
        assert not isinstance(obj, (logging.Handler, logging.Manager, logging.Filter)), path
        assert not isinstance(obj, (types.FrameType, types.CodeType, types.TracebackType)), path
        if isinstance(obj, types.ModuleType):
            assert obj.__name__ in ALLOWED, path
        if isinstance(obj, dict):
            namespaces = [vars(m) for m in list(sys.modules.values()) if hasattr(m, "__dict__")]
            assert not any(obj is n for n in namespaces), path


# -- the call rule on everything the walk reaches ---------------------------------------------

#: The source files of the allow-listed modules: code whose source is here is theirs.
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


def test_the_call_rule_admits_only_what_is_safe_to_call(guard: Guard) -> None:
    """Everything callable the value guard lets a caller reach (no step rule here: the
    call rule must hold on its own) is judged; what it admits, the oracle finds safe; and
    the capability wrappers the review found are among what it meets and refuses."""
    roots = [(name, importlib.import_module(name)) for name in sorted(ALLOWED)]
    roots += [
        ("<generator>", diag.count(2)),
        ("<holder>", security_probe.Holder()),
        ("<model>", security_probe.make_model()),
        ("<tensor>", torch.zeros(2, 2)),
        ("<array>", np.zeros(2)),
        ("<logger>", logging.getLogger("security.walk")),
        ("<exception>", security_probe.caught()),
    ]
    seen = reachable(guard, roots, depth=3)
    admitted, refused = [], []
    for path, obj in seen.values():
        if callable(obj):
            (admitted if guard.calls.reason(obj) is None else refused).append((path, obj))
    unsafe = [path for path, obj in admitted if not call_oracle(obj)]
    assert unsafe == []
    assert len(admitted) > 3000 and len(refused) > 300, (len(admitted), len(refused))
    # (An object reached twice is recorded under the first path the walk found.)
    refused_paths = {path for path, _ in refused}
    for tail in ("<model>.compile", "<model>.share_memory", "<model>.register_forward_hook",
                 "<model>._apply", "<tensor>.untyped_storage", "<tensor>.share_memory_",
                 "<tensor>.register_hook", ".Level._convert_", ".Level._create_",
                 "forward_context.defaultdict", "vllm_bridge.demo.rank._save_weights",
                 "security_probe.DEDENT"):
        assert any(path.endswith(tail) for path in refused_paths), tail


CAPABILITY_WRAPPERS = [
    ("Module.compile", lambda: torch.nn.Linear(1, 1).compile),
    ("Module.share_memory", lambda: torch.nn.Linear(1, 1).share_memory),
    ("Module._apply", lambda: torch.nn.Linear(1, 1)._apply),
    ("Module.register_forward_hook", lambda: torch.nn.Linear(1, 1).register_forward_hook),
    ("Module.compile, unbound", lambda: torch.nn.Module.compile),
    ("Tensor.untyped_storage", lambda: torch.zeros(1).untyped_storage),
    ("Tensor.storage", lambda: torch.zeros(1).storage),
    ("Tensor.register_hook", lambda: torch.zeros(1).register_hook),
    ("Tensor.as_subclass", lambda: torch.zeros(1).as_subclass),
    ("Tensor.untyped_storage, unbound", lambda: torch.Tensor.untyped_storage),
    ("ndarray.tofile", lambda: np.zeros(1).tofile),
    ("str.format", lambda: "".format),
    ("str.format, unbound", lambda: str.format),
    ("Enum._convert_", lambda: diag.Level._convert_),
    ("Enum._create_", lambda: diag.Level._create_),
    ("Enum._missing_", lambda: diag.Level._missing_),
    ("Logger.addFilter", lambda: logging.getLogger("x").addFilter),
    ("Logger.filters.append: a list method, which the step rule keeps out of reach",
     None),
    ("a foreign function", lambda: security_probe.DEDENT),
    ("a foreign class", lambda: collections.OrderedDict),
    ("a foreign callable instance", lambda: np.add),
    ("a partial of a foreign function", lambda: functools.partial(security_probe.DEDENT)),
    ("a staticmethod of a foreign function", lambda: staticmethod(security_probe.DEDENT)),
    ("an lru_cache of a foreign function", lambda: functools.lru_cache(security_probe.DEDENT)),
    ("a type alias of a foreign class", lambda: collections.OrderedDict[int, int]),
]  # fmt: skip


@pytest.mark.parametrize(
    "make", [m for _, m in CAPABILITY_WRAPPERS if m is not None],
    ids=[n for n, m in CAPABILITY_WRAPPERS if m is not None],
)
def test_capability_wrappers_may_not_be_called(make: Any) -> None:
    rule = CallRule(ALLOWED)
    fn = make()
    assert rule.reason(fn) is not None
    assert not call_oracle(fn)
    with pytest.raises(BadArgument, match=guard_tables.CALL_RULE):
        rule.check(fn, "x")


def test_ordinary_callables_may_be_called() -> None:
    rule = CallRule(ALLOWED)
    model = torch.nn.Linear(1, 1)
    ordinary = [
        diag.add, diag.Sample, diag.Opaque().bump, diag.Opaque.bump, diag.Level,
        security_probe.square, security_probe.PARTIAL_ADD, security_probe.Holder.make,
        staticmethod(diag.add), model, model.forward, model.state_dict, model.train,
        torch.zeros(1).sum, torch.Tensor.sum, np.zeros(1).sum, [].append, list.append,
        {}.get, dict.fromkeys, "a".upper, str.upper, (1).bit_length, int.from_bytes,
        list, dict, list[int], diag.count(1).send, logging.getLogger("x").info,
        vllm_bridge.forward_context.set_forward_context,
        vllm_bridge.forward_context.configure_batchsize_tracking,
    ]  # fmt: skip
    assert [fn for fn in ordinary if rule.reason(fn) is not None] == []
    assert [fn for fn in ordinary if not call_oracle(fn)] == []


def test_an_enum_is_called_with_one_value_only() -> None:
    rule = CallRule(ALLOWED)
    rule.check(diag.Level, "x", [2], {})
    for args, kwargs in (([2, 3], {}), (["X"], {"names": "A"}), ([], {"value": 2})):
        with pytest.raises(BadArgument, match="functional API"):
            rule.check(diag.Level, "x", args, kwargs)
    assert id(diag.Level) not in rule.passed  # its verdict depends on the arguments
    # Behind a partial (an allow-listed module could hold one), counting what it adds.
    rule.check(functools.partial(diag.Level), "x", [2], {})
    for fn, args in ((functools.partial(diag.Level, "X"), ["A B"]),
                     (functools.partial(diag.Level, names="A"), ["X"]),
                     (staticmethod(functools.partial(diag.Level)), ["X", "A"])):
        with pytest.raises(BadArgument, match="functional API"):
            rule.check(fn, "x", args, {})


def test_the_call_rule_agrees_with_itself_cold_and_warm() -> None:
    model = torch.nn.Linear(1, 1)
    values = [v for _, v in CAPABILITIES] + list(ORDINARY_BUILTINS) + [
        diag.add, diag.Opaque().bump, model, model.forward, model.compile, torch.zeros(1).sum,
        torch.zeros(1).untyped_storage, [].append, "".format, diag.Level._convert_,
        security_probe.DEDENT, np.add, list[int], functools.partial(diag.add, 1),
    ]  # fmt: skip
    cold = [CallRule(ALLOWED).reason(v) for v in values]
    warm = CallRule(ALLOWED)
    for _ in range(3):  # the first pass fills the caches, the others read them
        assert [warm.reason(v) for v in values] == cold
        for value, verdict in zip(values, cold):
            if verdict is None:
                warm.check(value, "x")
            else:
                with pytest.raises(BadArgument):
                    warm.check(value, "x")


# -- fast paths agree with the general ones -------------------------------------------


def sample_values() -> list[Any]:
    return [v for _, v in CAPABILITIES] + list(ORDINARY_BUILTINS) + [
        diag, diag.add, diag.Opaque(), diag.Opaque().bump, [].append, torch.zeros(1).sum,
        vars(builtins), [], {}, security_probe.square, os, functools.partial(diag.add, 1),
    ]  # fmt: skip


def test_check_agrees_with_reason_cold_and_warm() -> None:
    values = sample_values()
    cold = Guard(ALLOWED)
    verdicts = [cold.reason(v) for v in values]
    for _ in range(2):  # the first pass fills the caches, the second reads them
        warm = Guard(ALLOWED)
        for value, verdict in zip(values, verdicts):
            for _ in range(2):
                try:
                    warm.check(value, "x")
                    refused = None
                except BadArgument as exc:
                    refused = str(exc)
                assert (refused is None) == (verdict is None), value
                if verdict is not None:
                    assert verdict in refused  # type: ignore[operator]
                assert warm.reason(value) == verdict


ONE_STEP = [
    ("vllm_bridge.bridge.diag", "add"), ("vllm_bridge.bridge.diag", "os"), ("vllm_bridge.bridge.diag", "Level"),
    ("vllm_bridge.bridge.diag", "_journal"), ("vllm_bridge.bridge.diag", "dataclass"),
    ("vllm_bridge.bridge.diag", "missing"), ("security_probe", "SYSTEM"),
    ("security_probe", "BUILTINS"), ("security_probe", "square"),
    ("security_probe", "STATIC_SYSTEM"), ("security_probe", "Holder"),
]  # fmt: skip


@pytest.mark.parametrize("module,path", ONE_STEP)
def test_the_one_step_fast_path_agrees_with_the_walk(module: str, path: str) -> None:
    resolver = TargetResolver(sorted(ALLOWED))
    root = resolver.module(module)

    def outcome(fn: Any) -> Any:
        try:
            return ("ok", fn())
        except BadArgument as exc:
            return ("refused", str(exc))

    fast = outcome(lambda: resolver.resolve(ModuleTarget(module, path), None, None)[0])  # type: ignore[arg-type]
    general = outcome(lambda: resolver.walk(root, path, module))
    assert fast[0] == general[0]
    if fast[0] == "ok":
        assert fast[1] is general[1]
    else:
        assert fast[1] == general[1]
