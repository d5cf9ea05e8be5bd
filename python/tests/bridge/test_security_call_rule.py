"""The call rule on its own (python/vllm_bridge/bridge/worker/guard_calls.py), in this process.

Of everything callable that the value guard lets a caller reach (guard_oracle.reachable),
the call rule may admit only what the test's own judgement (guard_oracle.call_oracle:
where the code's source file is, which methods wrap a capability) says is safe to call;
the capability wrappers the review found are refused, ordinary callables admitted, an
enum called with one value only, and the rule's cached verdicts agree with its cold ones.
"""

from __future__ import annotations

import collections
import functools
import importlib
import logging
from typing import Any

from guard_oracle import (
    ALLOWED,
    CAPABILITIES,
    ORDINARY_BUILTINS,
    call_oracle,
    reachable,
)
import numpy as np
import pytest
import security_probe
import torch

import vllm_bridge
from vllm_bridge.bridge import diag
from vllm_bridge.bridge.protocol.errors import BadArgument
from vllm_bridge.bridge.worker import guard_tables
from vllm_bridge.bridge.worker.guard import Guard
from vllm_bridge.bridge.worker.guard_calls import CallRule


@pytest.fixture(scope="module")
def guard() -> Guard:
    return Guard(ALLOWED)


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
