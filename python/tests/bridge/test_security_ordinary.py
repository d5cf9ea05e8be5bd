"""Ordinary use still works under the value guard (docs/SECURITY.md), through a real
worker: a torch module returned by reference and its methods, attributes, parameters and
submodules; tensors by value and by reference; dataclasses and enums; cached and partial
functions of an allow-listed module; a list attribute's ``append``; generators streamed by
reference; exceptions and allow-listed modules held by reference; numpy values."""

from __future__ import annotations


import pytest
import torch
from conftest import WorkerProc, same
from security_support import D, P, w  # noqa: F401 - the fixture

from vllm_bridge.bridge.diag import Level, Sample
from vllm_bridge.bridge.protocol import Atom, Ref


def test_a_torch_module_by_reference(w: WorkerProc) -> None:
    model = w.call(P, "make_model")
    assert isinstance(model, Ref) and model.type_name == "torch.nn.modules.container.Sequential"
    x = torch.ones(2, 3)
    out = w.invoke(["r", model, "forward"], [x])
    assert out.shape == (2, 2) and bool((out >= 0).all())
    # An attribute path through a submodule, by value.
    weight = w.get(["r", model, "0.weight"])
    assert isinstance(weight, torch.Tensor) and weight.shape == (2, 3)
    # state_dict: an ordered dict of tensors, by value.
    state = w.invoke(["r", model, "state_dict"])
    assert sorted(state) == ["0.bias", "0.weight"]
    assert same(state["0.weight"], weight)
    # parameters(): a generator, held by reference and streamed.
    params = w.invoke(["r", model, "parameters"])
    assert [tuple(p.shape) for p in w.stream(["r", params, None], [])] == [(2, 3), (2,)]
    # train(False) returns the module itself: a new reference to it.
    again = w.invoke(["r", model, "train"], [False])
    assert isinstance(again, Ref) and again.ref_id != model.ref_id
    assert w.get(["r", model, "training"]) is False
    # A submodule by reference, and its own method.
    linear = w.get(["r", model, "0"])
    assert isinstance(linear, Ref) and linear.type_name.endswith("Linear")
    assert same(w.invoke(["r", linear, "forward"], [x]), x @ weight.T + state["0.bias"])


def test_tensors(w: WorkerProc) -> None:
    t = torch.arange(6.0).reshape(2, 3)
    assert same(w.call(D, "echo", t), t)
    sparse = w.call(P, "sparse")  # not strided: held by reference
    assert isinstance(sparse, Ref)
    assert same(w.invoke(["r", sparse, "to_dense"]), torch.eye(3))
    assert w.invoke(["r", sparse, "sum"]).item() == 3.0


def test_dataclasses_and_enums(w: WorkerProc) -> None:
    sample = Sample("s", Level.HIGH, [1, 2])
    assert w.call(D, "echo", sample) == sample
    assert w.call(D, "Sample", "t", Atom("low")) == Sample("t", Level.LOW)
    assert w.call(D, "level_name", Atom("high")) == "HIGH"
    # A dataclass field that cannot travel by value becomes a reference.
    holder = w.call(P, "holder")
    carried = w.call(D, "Sample", "h", Level.LOW, holder)
    assert carried.name == "h" and isinstance(carried.payload, Ref)
    assert w.invoke(["r", carried.payload, "method"]) == 3


def test_wrapped_functions_of_an_allow_listed_module(w: WorkerProc) -> None:
    assert w.call(P, "square", 4) == 16  # functools.lru_cache
    assert w.call(P, "PARTIAL_ADD", 2) == 3  # functools.partial of an allowed function
    assert w.call(P, "Holder.make") != w.call(P, "Holder.make")  # a class method


def test_a_list_attribute_and_instance_methods(w: WorkerProc) -> None:
    w.call(P, "LOG_LINES.clear")
    assert w.call(P, "LOG_LINES.append", "x") is None
    assert w.get(["m", P, "LOG_LINES"]) == ["x"]
    holder = w.call(P, "holder")
    assert w.invoke(["r", holder, "method"]) == 3
    assert w.get(["r", holder, "value"]) == 3
    assert w.call(D, "Opaque.bump", w.call(D, "opaque", 1), 2) == 3


def test_generators_streamed_by_reference(w: WorkerProc) -> None:
    g = w.call(P, "gen")
    assert w.stream(["r", g, None], []) == [1, 2]
    counter = w.call(D, "count", 2)
    assert w.invoke(["r", counter, "send"], [None]) == 0
    assert w.stream(["r", counter, None], []) == [1]


def test_exceptions_and_allowed_modules_by_reference(w: WorkerProc) -> None:
    exc = w.call(P, "caught")
    assert exc.type_name == "builtins.ValueError"
    assert w.get(["r", exc, "args"]) == ("caught",)
    diag = w.call(P, "module", D)  # an allow-listed module may be held
    assert w.invoke(["r", diag, "add"], [2, 3]) == 5
    fn = w.get(["m", D, "add"])  # so may its functions
    assert w.invoke(["r", fn, None], [4, 5]) == 9


def test_numpy_values(w: WorkerProc) -> None:
    values = w.call(P, "numpy_values")
    assert values[0] == 1.5 and values[1] == 3
    assert same(values[2], torch.arange(3))
    arr = w.call(P, "object_array")  # dtype object: by reference, its plain methods work
    assert w.invoke(["r", arr, "tolist"]) == [1, "a"]
