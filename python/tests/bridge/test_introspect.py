"""vllm_bridge.bridge.introspect: what the binding generator reads of the public modules."""

from __future__ import annotations

import collections
import importlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pytest
import torch

from vllm_bridge import PUBLIC_MODULES
from vllm_bridge.config import ParallelConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import BatchDescriptor
from vllm_bridge.bridge.introspect import describe_module, is_context_manager
from vllm_bridge.bridge.introspect.hints import by_value, describe_type, describe_value, union

MODULES = [m for m in PUBLIC_MODULES if m != "vllm_bridge.bridge.diag"]

#: The names vLLM's bindings of forward_context have beyond the module's __all__
#: (seeds/elixir_bindings_forward_context.txt); the generator asks for the same.
SEED_PRIVATE = [
    "_compute_chunked_local_num_tokens",
    "_compute_sp_num_tokens",
    "_forward_context",
    "logger",
]


def by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in items}


@pytest.fixture(scope="module")
def fc() -> dict[str, Any]:
    return describe_module("vllm_bridge.forward_context", also=SEED_PRIVATE)


# -- types ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hint", "expected"),
    [
        (int, {"kind": "int"}),
        (bool, {"kind": "bool"}),
        (float, {"kind": "float"}),
        (str, {"kind": "str"}),
        (bytes, {"kind": "bytes"}),
        (None, {"kind": "none"}),
        (type(None), {"kind": "none"}),
        (Any, {"kind": "any"}),
        ("NotResolved", {"kind": "any"}),
        (torch.Tensor, {"kind": "tensor"}),
        (np.ndarray, {"kind": "tensor"}),
        (list[int], {"kind": "list", "item": {"kind": "int"}}),
        (Sequence[str], {"kind": "list", "item": {"kind": "str"}}),
        (list, {"kind": "list", "item": {"kind": "any"}}),
        (dict[str, float], {"kind": "dict", "key": {"kind": "str"}, "value": {"kind": "float"}}),
        (
            collections.defaultdict[int, list[float]],
            {"kind": "dict", "key": {"kind": "int"}, "value": {"kind": "list", "item": {"kind": "float"}}},
        ),
        (tuple[int, str], {"kind": "tuple", "items": [{"kind": "int"}, {"kind": "str"}]}),
        (tuple[int, ...], {"kind": "tuple", "item": {"kind": "int"}}),
        (int | None, {"kind": "union", "of": [{"kind": "int"}, {"kind": "none"}]}),
        (Optional[str], {"kind": "union", "of": [{"kind": "str"}, {"kind": "none"}]}),
        (int | Any, {"kind": "any"}),
        (
            BatchDescriptor,
            {"kind": "dataclass", "class": "vllm_bridge.forward_context.BatchDescriptor"},
        ),
        (
            CUDAGraphMode,
            {
                "kind": "enum",
                "class": "vllm_bridge.cudagraph.CUDAGraphMode",
                "members": ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"],
            },
        ),
        (slice, {"kind": "ref", "class": "slice"}),
        (frozenset[int], {"kind": "ref", "class": "frozenset"}),
        (collections.abc.Callable[[], None], {"kind": "ref", "class": "collections.abc.Callable"}),
    ],
)
def test_describe_type(hint: Any, expected: dict[str, Any]) -> None:
    assert describe_type(hint) == expected


def test_nested_unions_flatten_without_duplicates() -> None:
    assert describe_type((int | None) | (str | int)) == union(
        [{"kind": "int"}, {"kind": "none"}, {"kind": "str"}]
    )


def test_a_dataclass_outside_the_public_modules_travels_by_reference() -> None:
    @dataclass
    class Local:
        x: int

    assert not by_value(Local)
    assert describe_type(Local)["kind"] == "ref"
    assert by_value(ParallelConfig) and by_value(CUDAGraphMode)


# -- values -----------------------------------------------------------------------------------


def test_describe_value() -> None:
    assert describe_value(None) is None
    assert describe_value(3) == 3 and describe_value(True) is True
    assert describe_value(0.5) == 0.5 and describe_value("s") == "s"
    assert describe_value([1, (2, 3)]) == [1, {"tuple": [2, 3]}]
    assert describe_value({"a": 1, 2: None}) == {"dict": [["a", 1], [2, None]]}
    assert describe_value(CUDAGraphMode.FULL) == {
        "enum": "vllm_bridge.cudagraph.CUDAGraphMode",
        "member": "FULL",
    }
    assert describe_value(BatchDescriptor(4)) == {
        "dataclass": "vllm_bridge.forward_context.BatchDescriptor",
        "fields": {
            "num_tokens": 4,
            "num_reqs": None,
            "uniform": False,
            "has_lora": False,
            "num_active_loras": 0,
        },
    }
    assert describe_value(float("nan")) == {"repr": "nan"}
    assert describe_value(2**70) == {"repr": str(2**70)}


def test_a_repr_with_an_address_is_replaced_by_the_type() -> None:
    assert describe_value(object()) == {"repr": "<object object>"}
    assert describe_value(lambda: 1) == {"repr": "<function object>"}


# -- modules ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODULES)
def test_output_is_plain_json_data_and_deterministic(name: str) -> None:
    first = describe_module(name)
    assert json.loads(json.dumps(first)) == first
    assert describe_module(name) == first
    for key in ("functions", "classes", "aliases", "attributes"):
        names = [item["name"] for item in first[key]]
        assert names == sorted(names)


def test_outside_a_worker_refuses_a_module_outside_the_public_ones() -> None:
    # In a worker, the worker's allow-list rules (test_introspect_allowlist.py).
    with pytest.raises(ValueError, match="'os' is not on this worker's allow-list"):
        describe_module("os")
    with pytest.raises(ValueError, match="vllm_bridge.bridge.worker"):
        describe_module("vllm_bridge.bridge.worker")
    with pytest.raises(TypeError, match="module name"):
        describe_module(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="also must be a list or tuple of names"):
        describe_module("vllm_bridge.config", "yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="also must be a list or tuple of names"):
        describe_module("vllm_bridge.config", [1])  # type: ignore[list-item]


def test_forward_context_functions(fc: dict[str, Any]) -> None:
    functions = by_name(fc["functions"])
    # Those listed in __all__ (defined here or not) and the private ones asked for.
    assert {
        "_compute_chunked_local_num_tokens",
        "_compute_sp_num_tokens",
        "coordinate_batch_across_dp",
        "create_forward_context",
        "get_forward_context",
        "init_logger",
        "is_forward_context_available",
        "override_forward_context",
        "set_forward_context",
    } <= set(functions)
    # Imported helpers and private helpers that the module does not export are not its API.
    assert not {"check_instance", "contextmanager", "field"} & set(functions)
    assert "_make_dp_metadata" not in functions
    assert functions["coordinate_batch_across_dp"]["defined_in"] == "vllm_bridge.dp"

    public = by_name(describe_module("vllm_bridge.forward_context")["functions"])
    assert not [name for name in public if name.startswith("_")]


def test_set_forward_context_signature(fc: dict[str, Any]) -> None:
    f = by_name(fc["functions"])["set_forward_context"]
    assert f["context_manager"] is True and f["yields"] == {"kind": "none"}
    params = f["params"]
    assert [p["name"] for p in params[:3]] == ["attn_metadata", "vllm_config", "virtual_engine"]
    assert "default" not in params[0] and params[0]["type"] == {"kind": "any"}
    assert params[1]["type"] == {"kind": "dataclass", "class": "vllm_bridge.config.VllmConfig"}
    assert params[2]["default"] == 0
    mode = by_name(params)["cudagraph_runtime_mode"]
    assert mode["default"] == {"enum": "vllm_bridge.cudagraph.CUDAGraphMode", "member": "NONE"}
    assert mode["type"]["kind"] == "enum"
    assert f["doc"].startswith("A context manager that stores the current forward context")


def test_context_managers_are_recognised(fc: dict[str, Any]) -> None:
    functions = by_name(fc["functions"])
    cms = {name for name, f in functions.items() if f["context_manager"]}
    assert cms == {"set_forward_context", "override_forward_context"}
    methods = by_name(by_name(fc["classes"])["DPMetadata"]["methods"])
    assert methods["chunked_sizes"]["context_manager"] is True
    assert methods["chunked_sizes"]["yields"] == {"kind": "list", "item": {"kind": "int"}}
    assert methods["sp_local_sizes"]["context_manager"] is True
    assert methods["make"]["kind"] == "staticmethod"
    assert methods["cu_tokens_across_sp"]["params"][0]["type"]["kind"] == "dataclass"

    def gen() -> Iterator[int]:
        yield 1

    assert not is_context_manager(gen)


def test_module_attributes_include_live_ones(fc: dict[str, Any]) -> None:
    attributes = by_name(fc["attributes"])
    assert set(attributes) == {
        "_forward_context",
        "batchsize_forward_time",
        "batchsize_logging_interval",
        "current_platform",
        "forward_start_time",
        "last_logging_time",
        "logger",
        "track_batchsize",
    }
    assert attributes["_forward_context"]["live"] is True
    assert attributes["_forward_context"]["type"] == {
        "kind": "union",
        "of": [
            {"kind": "dataclass", "class": "vllm_bridge.forward_context.ForwardContext"},
            {"kind": "none"},
        ],
    }
    assert attributes["track_batchsize"]["type"] == {"kind": "bool"}
    assert attributes["logger"] == {
        "name": "logger",
        "type": {"kind": "ref", "class": "logging.Logger"},
        "live": False,
    }
    assert attributes["current_platform"]["type"]["class"] == "vllm_bridge.platforms.Platform"


def test_dataclasses_and_enums() -> None:
    fc = describe_module("vllm_bridge.forward_context")
    bd = by_name(fc["classes"])["BatchDescriptor"]
    assert bd["kind"] == "dataclass" and bd["frozen"] is True
    assert [f["name"] for f in bd["fields"]] == [
        "num_tokens",
        "num_reqs",
        "uniform",
        "has_lora",
        "num_active_loras",
    ]
    assert "default" not in bd["fields"][0]
    assert bd["fields"][1]["default"] is None

    context = by_name(fc["classes"])["ForwardContext"]
    extra = by_name(context["fields"])["additional_kwargs"]
    assert extra["default"] == {"dict": []} and extra["default_factory"] is True

    config = by_name(describe_module("vllm_bridge.config")["classes"])["VllmConfig"]
    parallel = by_name(config["fields"])["parallel_config"]
    assert parallel["default"]["dataclass"] == "vllm_bridge.config.ParallelConfig"

    mode = by_name(describe_module("vllm_bridge.cudagraph")["classes"])["CUDAGraphMode"]
    assert mode["kind"] == "enum"
    assert mode["members"][3] == {"name": "FULL_DECODE_ONLY", "value": {"tuple": [2, 0]}}
    assert "has_mode" in by_name(mode["methods"])


def test_aliases_and_properties() -> None:
    ubatch = describe_module("vllm_bridge.ubatch")
    alias = by_name(ubatch["aliases"])["UBatchSlices"]
    item = {"kind": "dataclass", "class": "vllm_bridge.ubatch.UBatchSlice"}
    assert alias["returns"] == {"kind": "list", "item": item}
    assert alias["params"][0]["kind"] == "positional_only"
    methods = by_name(by_name(ubatch["classes"])["UBatchSlice"]["methods"])
    assert methods["num_tokens"]["kind"] == "property"
    assert methods["num_tokens"]["path"] == "UBatchSlice.num_tokens.fget"
    assert methods["num_tokens"]["returns"] == {"kind": "int"}


@pytest.mark.parametrize("name", MODULES)
def test_a_module_with_all_is_described_by_its_all(name: str) -> None:
    module = importlib.import_module(name)
    described = describe_module(name)
    kinds = ("functions", "classes", "aliases", "attributes")
    names = {item["name"] for key in kinds for item in described[key]}
    assert names <= set(module.__all__)
    # Every exported function, alias and data attribute is described; classes only where
    # defined here by value (DPGroupError, an exception, travels by reference).
    for attr in module.__all__:
        value = getattr(module, attr)
        if not isinstance(value, type):
            assert attr in names, attr


def test_private_names_only_when_asked_for() -> None:
    assert [c["name"] for c in describe_module("vllm_bridge.dp")["classes"]] == ["DPGroupInfo"]
    asked = describe_module("vllm_bridge.dp", also=["_State"])
    assert "_State" in [c["name"] for c in asked["classes"]]
    plain = describe_module("vllm_bridge.forward_context")
    assert not [f["name"] for f in plain["functions"] if f["name"].startswith("_")]
    assert "logger" not in {a["name"] for a in plain["attributes"]}


def test_a_module_without_all_is_described_by_the_public_names_it_defines() -> None:
    # vllm_bridge.bridge.diag has no __all__: its own public functions, classes and assignments;
    # not its private helpers (_spin_until, _LOG_LEVELS), nor what it imports.
    diag = describe_module("vllm_bridge.bridge.diag")
    functions = {f["name"] for f in diag["functions"]}
    assert {"echo", "add", "sleep", "fail", "count", "recorder"} <= functions
    assert not [f for f in functions if f.startswith("_")]
    assert {c["name"] for c in diag["classes"]} == {"Level", "Sample"}
    names = functions | {a["name"] for key in ("attributes", "aliases") for a in diag[key]}
    imported = {"dataclass", "Iterator", "Any", "NoReturn", "contextvars", "os", "_LOG_LEVELS"}
    assert not imported & names
    asked = describe_module("vllm_bridge.bridge.diag", also=["_spin_until"])
    assert "_spin_until" in {f["name"] for f in asked["functions"]}


def test_names_that_are_not_bindable_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    not_bindable = "'_nope' \\(of also\\) is not a bindable attribute of vllm_bridge.dp"
    with pytest.raises(ValueError, match=not_bindable):
        describe_module("vllm_bridge.dp", also=["_nope"])
    with pytest.raises(ValueError, match="'__name__' \\(of also\\)"):
        describe_module("vllm_bridge.dp", also=["__name__"])
    dp = importlib.import_module("vllm_bridge.dp")
    monkeypatch.setattr(dp, "__all__", [*dp.__all__, "gone"])
    with pytest.raises(ValueError, match="'gone' \\(of vllm_bridge.dp.__all__\\)"):
        describe_module("vllm_bridge.dp")
    monkeypatch.setattr(dp, "__all__", "coordinate_batch_across_dp")
    with pytest.raises(TypeError, match="vllm_bridge.dp.__all__ must be a list or tuple"):
        describe_module("vllm_bridge.dp")
