"""The value guard on its own (python/vllm_bridge/bridge/worker/guard.py), in this process.

Against the oracle of guard_oracle.py (built apart from the guard's tables): everything a
capability module defines, the evaluating builtins and the interpreter's objects are
refused; a breadth-first walk over every attribute path the guard lets through, from
each allow-listed module and from objects calls hand back, meets none of them nor the
worker's own state. Ordinary values pass, and the cached fast paths agree with the
uncached verdicts. The call rule has its own tests: test_security_call_rule.py.
"""

from __future__ import annotations

import builtins
import collections
import functools
import importlib
import logging
import os
import sys
import types
from typing import Any

from guard_oracle import (
    ALLOWED,
    CAPABILITIES,
    CAPABILITY_MODULES,
    EVALUATING_BUILTINS,
    ORDINARY_BUILTINS,
    WORKER_CLASSES,
    reachable,
)
import numpy as np
import pytest
import security_probe
import torch

import vllm_bridge
from vllm_bridge.bridge import diag
from vllm_bridge.bridge.protocol.errors import BadArgument
from vllm_bridge.bridge.protocol.messages import ModuleTarget
from vllm_bridge.bridge.worker import guard_tables
from vllm_bridge.bridge.worker.guard import Guard
from vllm_bridge.bridge.worker.targets import TargetResolver


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


D = "vllm_bridge.bridge.diag"
ONE_STEP = [
    (D, "add"), (D, "os"), (D, "Level"), (D, "_journal"), (D, "dataclass"), (D, "missing"),
    ("security_probe", "SYSTEM"),
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

    target = ModuleTarget(module, path)
    fast = outcome(lambda: resolver.resolve(target, None, None)[0])  # type: ignore[arg-type]
    general = outcome(lambda: resolver.walk(root, path, module))
    assert fast[0] == general[0]
    if fast[0] == "ok":
        assert fast[1] is general[1]
    else:
        assert fast[1] == general[1]
