"""What a caller may *call* (python/vllm_bridge/bridge/worker/guard_calls.py, docs/SECURITY.md,
"What may be called"), through real workers.

The value guard judges methods by where they are at home, against a list of refused
homes; a method of an ordinary object that wraps a capability passed it. The review's
findings: a torch module's ``compile`` ran a compiler of the caller's choosing, an enum
class's ``_convert_`` replaced ``builtins.len`` and killed the worker. The call rule is
positive: only code defined in an allow-listed module, or a listed method of a value type,
may be called, whatever reaches it (a path, a reference called with no path, a reference
passed as an argument). Each refusal names the callable, where it is defined and the rule,
and the worker serves on; ordinary calls keep working.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import WorkerProc, spawn_worker
from security_support import D, FC, P, refused, w  # noqa: F401 - the fixture

from vllm_bridge.bridge.diag import Level
from vllm_bridge.bridge.protocol import Ref
from vllm_bridge.bridge.worker import guard_tables as t


def refused_call(attempt: Any, what: str, home: str) -> str:
    """``attempt`` is refused by the call rule: the message names ``what`` was to be
    called, ``home`` (where it is defined) and the rule."""
    message = refused(attempt)
    assert what in message, message
    assert f"defined in {home}, which no caller may call" in message, message
    assert t.CALL_RULE in message, message
    return message


def serves(w: WorkerProc) -> None:
    assert w.call(D, "add", 1, 2) == 3
    assert w.call(D, "echo", [1, 2]) == [1, 2]


# -- 1. a torch module's compile: torch.compile with the caller's options ------------------


def test_compile_is_refused_and_no_compiler_runs(w: WorkerProc, tmp_path: Path) -> None:
    marker = tmp_path / "compiler-ran"
    cc = tmp_path / "cc.sh"
    cc.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    cc.chmod(0o755)
    model = w.call(P, "make_model")
    options = {"options": {"cpp.cxx": (str(cc),), "fx_graph_cache": False}}
    refused_call(
        lambda: w.invoke(["r", model, "compile"], [], options),
        f"reference {model.ref_id} (torch.nn.modules.container.Sequential).compile is the "
        "method torch.nn.modules.container.Sequential.compile",
        "torch.nn.modules.module",
    )
    # Calling the module itself (its __call__, a reference with no path) runs its forward,
    # uncompiled: no compiler ran.
    out = w.invoke(["r", model, None], [torch.ones(2, 3)])
    assert isinstance(out, torch.Tensor) and out.shape == (2, 2)
    assert not marker.exists()
    serves(w)


MODULE_WRAPPERS = [
    "compile", "share_memory", "register_forward_hook", "register_forward_pre_hook",
    "register_full_backward_hook", "register_full_backward_pre_hook", "register_module",
    "add_module", "register_buffer", "register_parameter", "set_submodule", "to_empty",
    "register_state_dict_pre_hook", "register_load_state_dict_post_hook",
]  # fmt: skip


@pytest.mark.parametrize("name", MODULE_WRAPPERS)
def test_a_torch_module_offers_only_its_listed_methods(w: WorkerProc, name: str) -> None:
    model = w.call(P, "make_model")
    refused_call(lambda: w.invoke(["r", model, name], []), f").{name} is the method",
                 "torch.nn.modules.module")
    serves(w)


TENSOR_WRAPPERS = [
    "untyped_storage", "storage", "storage_type", "share_memory_", "data_ptr", "set_",
    "register_hook", "register_post_accumulate_grad_hook", "apply_", "map_", "as_subclass",
]  # fmt: skip


@pytest.mark.parametrize("name", TENSOR_WRAPPERS)
def test_a_tensor_offers_its_public_methods_but_storage_hooks_and_callbacks(
    w: WorkerProc, name: str
) -> None:
    sparse = w.call(P, "sparse")  # held by reference
    message = refused(lambda: w.invoke(["r", sparse, name], []))
    assert f").{name} is the method torch.Tensor.{name}" in message, message
    assert t.CALL_RULE in message


def test_an_arrays_writers_are_refused(w: WorkerProc) -> None:
    arr = w.call(P, "object_array")
    for name in ("tofile", "dump", "dumps"):
        message = refused(lambda: w.invoke(["r", arr, name], ["/tmp/x"]))
        assert f").{name} is the method numpy.ndarray.{name}" in message, message


# -- 2. enum's class machinery: _convert_, _create_, the functional API --------------------


def test_enum_convert_handed_out_is_refused_and_builtins_stay(w: WorkerProc) -> None:
    """The review's a3.py: ``Level._convert_("Pwn", "builtins", filter)`` set
    ``builtins.len`` to an enum member and killed the worker with every session."""
    w.call(D, "set_var", "kept", session="s")
    convert = w.call(P, "enum_convert")  # a bound method, handed out by a module
    assert isinstance(convert, Ref)
    keep = w.get(["r", w.call(D, "opaque", {"len": 1}), "value.get"])
    refused_call(
        lambda: w.invoke(["r", convert, None], ["Pwn", "builtins", keep]),
        f"reference {convert.ref_id} (builtins.method) is the method "
        "vllm_bridge.bridge.diag.Level._convert_",
        "enum",
    )
    serves(w)
    assert w.call(D, "get_var", session="s") == "kept"


def test_enum_create_is_refused(w: WorkerProc) -> None:
    create = w.call(P, "enum_create")
    refused_call(lambda: w.invoke(["r", create, None], ["X", ["A", "B"]]),
                 "is the method vllm_bridge.bridge.diag.Level._create_", "enum")


@pytest.mark.parametrize(
    "args,kwargs",
    [(["Pwn", ["A", "B"]], {}), (["Pwn", "A B"], {}), (["Pwn"], {"names": ["A"]}),
     ([2], {"module": "builtins"}), (["Pwn", "A", "B"], {})],
    ids=["names list", "names str", "names keyword", "a keyword", "three arguments"],
)
def test_the_functional_enum_api_is_refused(
    w: WorkerProc, args: list[Any], kwargs: dict[str, Any]
) -> None:
    message = refused(lambda: w.invoke(["m", D, "Level"], args, kwargs))
    assert "vllm_bridge.bridge.diag.Level is the enum class vllm_bridge.bridge.diag.Level" in message
    assert "functional API" in message
    held = w.get(["m", D, "Level"])  # the class held by reference: the same
    assert "functional API" in refused(lambda: w.invoke(["r", held, None], args, kwargs))


def test_an_enum_called_with_one_value_looks_a_member_up(w: WorkerProc) -> None:
    assert w.call(D, "Level", 2) == Level.HIGH
    assert w.invoke(["r", w.get(["m", D, "Level"]), None], [1]) == Level.LOW


# -- 3. the class: whatever the value guard lets through, only listed code is called ---------


FOREIGN = [
    ("a class re-exported by an allow-listed module", FC, "defaultdict", [],
     "the class collections.defaultdict", "collections"),
    ("a plain function of a module outside the allow-list", P, "DEDENT", ["  x"],
     "the function textwrap.dedent", "textwrap"),
    ("a function a public module imports from a private one", FC, "check_instance", ["n", 1],
     "the function vllm_bridge._checks.check_instance", "vllm_bridge._checks"),
    ("a torch function (torch is not allow-listed)", P, "RELU", [torch.ones(1)],
     "the builtin torch.", "torch"),
    ("a foreign class", P, "ORDERED", [], "the class collections.OrderedDict", "collections"),
    ("a foreign callable instance (its __call__)", P, "UFUNC", [1, 2],
     "a numpy.ufunc object", "numpy"),
]  # fmt: skip


@pytest.mark.parametrize("case", FOREIGN, ids=[c[0] for c in FOREIGN])
def test_what_is_defined_outside_the_allow_list_is_not_called(w: WorkerProc, case: Any) -> None:
    _, module, path, args, what, home = case
    refused_call(lambda: w.call(module, path, *args), f"{module}.{path} is {what}", home)
    held = w.get(["m", module, path])  # it may be read and held; calling it is refused
    assert isinstance(held, Ref)
    refused_call(lambda: w.invoke(["r", held, None], args), f"reference {held.ref_id} ", home)


RANK = "vllm_bridge.demo.rank"


def test_a_default_worker_refuses_the_demos_file_access(worker: WorkerProc, tmp_path: Path) -> None:
    """The demo's runner writes and reads files at paths its caller names
    (``save_weights``, ``load_model``): it is not on the default allow-list, so a worker
    started without ``--allow``/``--also-allow`` (a pool with default options) refuses it
    by name and touches no file."""
    target = tmp_path / "new" / "dir" / "w.pt"
    for name, args in (("save_weights", (str(target), 0)), ("load_model", (str(target),)),
                       ("create_runner", ())):
        message = refused(lambda: worker.call(RANK, name, *args))
        assert f"module '{RANK}' is not in the worker's allow-list" in message, message
        assert not (tmp_path / "new").exists()
    assert RANK not in worker.hello["modules"]


def test_the_runners_private_re_export_does_not_write_files(tmp_path: Path) -> None:
    """``vllm_bridge.demo.rank._save_weights`` is ``vllm_bridge.demo.model.weights.save_weights``
    (a worker that allows the runner, as the demo's do, does not allow the model package)."""
    worker = spawn_worker(["--also-allow", RANK])
    try:
        path = tmp_path / "w.pt"
        refused_call(lambda: worker.call(RANK, "_save_weights", str(path), None, 0),
                     "vllm_bridge.demo.rank._save_weights is the function "
                     "vllm_bridge.demo.model.weights.save_weights",
                     "vllm_bridge.demo.model.weights")
        assert not path.exists()
        # The allow-listed wrapper is what a caller calls.
        assert worker.call(RANK, "save_weights", str(path), 0)["path"] == str(path)
        assert path.exists()
    finally:
        worker.stop()


def test_a_callable_argument_is_judged_as_a_call(w: WorkerProc) -> None:
    """Code that is given a callable may call it (``call_it(fn)``, ``list.sort(key=fn)``):
    a reference passed as an argument meets the call rule too."""
    model = w.call(P, "make_model")
    compile_ref = w.get(["r", model, "compile"])  # reading it is allowed: it is a value
    for attempt in (
        lambda: w.call(P, "call_it", compile_ref),
        lambda: w.call(P, "identity", compile_ref),
        lambda: w.call(P, "LOG_LINES.sort", key=compile_ref),
        lambda: w.call(P, "call_it", w.call(P, "enum_convert"), "X", "builtins", None),
    ):
        message = refused(attempt)
        assert "argument reference " in message, message
        assert "nor pass as an argument" in message and t.CALL_RULE in message
    # An allow-listed function, a torch module and a listed method pass as arguments.
    assert w.call(P, "call_it", w.get(["m", P, "add"]), 1, 2) == 3
    out = w.call(P, "call_it", model, torch.ones(1, 3))
    assert out.shape == (1, 2)
    assert w.call(P, "call_it", w.get(["m", P, "LOG_LINES.copy"])) == w.get(["m", P, "LOG_LINES"])
    serves(w)


# -- ordinary calls --------------------------------------------------------------------------


def test_ordinary_calls_of_a_torch_module(w: WorkerProc) -> None:
    model = w.call(P, "make_model")
    x = torch.ones(2, 3)
    assert same_shape(w.invoke(["r", model, None], [x]), (2, 2))  # __call__
    assert same_shape(w.invoke(["r", model, "forward"], [x]), (2, 2))
    assert w.invoke(["r", model, "eval"]).ref_id != model.ref_id
    assert w.get(["r", model, "training"]) is False
    assert w.invoke(["r", model, "requires_grad_"], [False]) is not None
    assert w.invoke(["r", model, "zero_grad"]) is None
    assert sorted(w.invoke(["r", model, "state_dict"])) == ["0.bias", "0.weight"]
    assert isinstance(w.invoke(["r", model, "get_submodule"], ["0"]), Ref)
    assert isinstance(w.invoke(["r", model, "to"], ["cpu"]), Ref)
    names = w.stream(["r", model, "named_children"], [])
    assert [n for n, _ in names] == ["0", "1"]
    w.call(P, "LOG_LINES.clear")
    w.invoke(["r", model, "apply"], [w.get(["m", P, "count_modules"])])
    assert w.get(["m", P, "LOG_LINES"]) == ["Linear", "ReLU", "Sequential"]


def test_ordinary_calls_of_values(w: WorkerProc) -> None:
    sparse = w.call(P, "sparse")
    assert w.invoke(["r", sparse, "to_dense"]).tolist() == torch.eye(3).tolist()
    assert w.invoke(["r", sparse, "coalesce"]).type_name == "torch.Tensor"
    assert w.invoke(["r", w.call(P, "object_array"), "tolist"]) == [1, "a"]
    assert w.call(D, "Level.HIGH.name.lower") == "high"
    assert w.call(P, "LOG_LINES.copy") == w.get(["m", P, "LOG_LINES"])
    gen = w.call(D, "count", 3)
    assert w.invoke(["r", gen, "send"], [None]) == 0
    assert w.invoke(["r", gen, "close"]) is None
    logger = w.call(FC, "init_logger", "security.calls")
    assert w.invoke(["r", logger, "warning"], ["from a caller"]) is None
    assert any(m[3] == "from a caller" for m in w.logs)
    assert w.invoke(["r", logger, "isEnabledFor"], [30]) is True
    assert isinstance(w.invoke(["r", logger, "getChild"], ["c"]), Ref)
    assert w.call(P, "Holder.make").type_name == "security_probe.Holder"  # a class method
    assert w.call(P, "square", 3) == 9 and w.call(P, "PARTIAL_ADD", 1) == 2


def test_a_type_alias_of_an_allow_listed_module_is_called(worker: WorkerProc) -> None:
    """``UBatchSlices = list[UBatchSlice]``: the binding calls it, which calls ``list``."""
    assert worker.call("vllm_bridge.ubatch", "UBatchSlices", []) == []
    assert worker.call("vllm_bridge.forward_context", "UBatchSlices", []) == []


def same_shape(value: Any, shape: tuple[int, ...]) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape) == shape
