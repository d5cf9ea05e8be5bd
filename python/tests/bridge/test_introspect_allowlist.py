"""vllm_bridge.bridge.introspect describes only modules of its worker's allow-list.

The binding generator's worker allow-lists the introspection module and the user's
modules (``--allow``); that must not make ``describe_module`` a way to import any module
by name. Through real workers: the user's module is described (its dataclass and enum by
value, the library's classes in its hints by value too); a module not allow-listed,
``os``, a dotted path below an allow-listed module, and names with odd characters are
refused, and none of them is imported.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import WorkerCallError, WorkerProc, spawn_worker
from vllm_bridge import PUBLIC_MODULES
from vllm_bridge.bridge.introspect import describable
from vllm_bridge.bridge.worker import allowlist

INTROSPECT = "vllm_bridge.bridge.introspect"
#: The user modules of the Elixir generator's tests (my_model, my_pkg.sub, my_broken).
USER_DIR = Path(__file__).resolve().parents[3] / "test" / "support" / "user_python"


def _env() -> dict[str, str]:
    paths = [str(USER_DIR), os.environ.get("PYTHONPATH")]
    return {"PYTHONPATH": os.pathsep.join(filter(None, paths))}


@pytest.fixture(scope="module")
def gen_worker() -> Iterator[WorkerProc]:
    """A worker set up as the generator sets up its own: introspection plus user modules."""
    wp = spawn_worker(
        ["--allow", INTROSPECT, "my_model", "my_pkg.sub", "my_broken"], env=_env()
    )
    try:
        yield wp
    finally:
        wp.stop()


def describe(wp: WorkerProc, name: Any, also: Any = ()) -> dict[str, Any]:
    return wp.call(INTROSPECT, "describe_module", name, list(also))


def by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in items}




def test_outside_a_worker_the_public_modules_are_describable() -> None:
    assert allowlist.current() is None
    assert describable() == PUBLIC_MODULES


def test_the_worker_publishes_its_allow_list_once(gen_worker: WorkerProc) -> None:
    assert gen_worker.call(INTROSPECT, "describable") == (
        INTROSPECT,
        "my_model",
        "my_pkg.sub",
        "my_broken",
    )


def test_a_user_module_on_the_allow_list_is_described(gen_worker: WorkerProc) -> None:
    described = describe(gen_worker, "my_model")
    assert described["module"] == "my_model"
    classes = by_name(described["classes"])
    assert classes["Cfg"]["kind"] == "dataclass"
    assert classes["Kind"]["kind"] == "enum"
    assert classes["MyModel"]["class"] == "my_model.MyModel"
    functions = by_name(described["functions"])
    assert functions["scope"]["context_manager"] is True
    kinds = {p["name"]: p["kind"] for p in functions["scaled"]["params"]}
    assert kinds == {
        "x": "positional_or_keyword",
        "factor": "positional_or_keyword",
        "offset": "keyword_only",
        "label": "keyword_only",
    }
    batch = functions["describe_batch"]
    # The library's classes in a user's hints travel by value (they have Vllm.* structs),
    # though this worker's allow-list does not name their modules.
    assert batch["params"][0]["type"] == {
        "kind": "dataclass",
        "class": "vllm_bridge.forward_context.BatchDescriptor",
    }
    assert batch["returns"]["kind"] == "enum"
    assert batch["returns"]["class"] == "vllm_bridge.cudagraph.CUDAGraphMode"
    # A field typed with the user's own enum is by value too (the worker's allow-list).
    width, kind, tags = classes["Cfg"]["fields"]
    assert kind["type"]["kind"] == "enum" and kind["type"]["class"] == "my_model.Kind"
    assert describe(gen_worker, "my_pkg.sub")["functions"][0]["name"] == "ping"


@pytest.mark.parametrize(
    "name",
    [
        "os",
        "vllm_bridge.forward_context",  # public, but not on this worker's list
        "my_model.dataclasses",  # a dotted path below an allow-listed module
        "my_model.contextlib",
        "my_pkg",  # the package of an allow-listed module is not itself listed
        "vllm_bridge.bridge.introspect.hints",
        "subprocess",
    ],
)
def test_a_module_not_on_the_allow_list_is_refused_and_not_imported(
    gen_worker: WorkerProc, name: str
) -> None:
    with pytest.raises(WorkerCallError) as err:
        describe(gen_worker, name)
    assert err.value.error["type"] == "python_exception"
    assert err.value.error["python_type"] == "ValueError"
    assert f"{name!r} is not on this worker's allow-list" in err.value.error["message"]


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "my_model.",
        ".my_model",
        "my model",
        "my_model\x00",
        "../my_model",
        "my-model",
        "my_model;os",
        "my_model/../os",
        "é\u0301.x y",
    ],
)
def test_names_with_odd_characters_are_refused(gen_worker: WorkerProc, name: str) -> None:
    with pytest.raises(WorkerCallError) as err:
        describe(gen_worker, name)
    assert err.value.error["python_type"] == "ValueError"
    assert "is not a dotted module name" in err.value.error["message"]


@pytest.mark.parametrize("name", [42, None, ["my_model"], b"my_model"])
def test_a_name_that_is_not_a_str_is_refused(gen_worker: WorkerProc, name: Any) -> None:
    with pytest.raises(WorkerCallError) as err:
        describe(gen_worker, name)
    assert err.value.error["python_type"] == "TypeError"


def test_a_refused_module_is_not_imported() -> None:
    """``my_broken`` raises RuntimeError when imported: refused with a ValueError, it was
    not imported (the refusal comes before any import)."""
    wp = spawn_worker(["--allow", INTROSPECT, "my_model"], env=_env())
    try:
        for name in ("my_broken", "my_model.my_broken"):
            with pytest.raises(WorkerCallError) as err:
                describe(wp, name)
            assert err.value.error["python_type"] == "ValueError", name
        assert describe(wp, "my_model")["module"] == "my_model"
    finally:
        wp.stop()


def test_an_allow_listed_module_that_fails_to_import_names_its_error(
    gen_worker: WorkerProc,
) -> None:
    with pytest.raises(WorkerCallError) as err:
        describe(gen_worker, "my_broken")
    assert err.value.error["python_type"] == "RuntimeError"
    assert "my_broken fails on purpose" in err.value.error["message"]


def test_a_missing_allow_listed_module_is_a_module_not_found_error() -> None:
    wp = spawn_worker(["--allow", INTROSPECT, "no_such_user_module"], env=_env())
    try:
        with pytest.raises(WorkerCallError) as err:
            describe(wp, "no_such_user_module")
        assert err.value.error["python_type"] == "ModuleNotFoundError"
        assert "no_such_user_module" in err.value.error["message"]
    finally:
        wp.stop()


def test_a_request_cannot_publish_or_reach_the_holder(gen_worker: WorkerProc) -> None:
    """The holder's module is not allow-listed: reaching it from introspect is refused,
    and so is calling its publish through any path."""
    for path in ("allowlist", "allowlist.publish", "allowlist._published"):
        with pytest.raises(WorkerCallError) as err:
            gen_worker.call(INTROSPECT, path, ["os"])
        assert err.value.error["type"] == "bad_argument", path
    assert gen_worker.call(INTROSPECT, "describable")[0] == INTROSPECT


def test_publish_is_once_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allowlist, "_published", None)
    with pytest.raises(TypeError, match="42"):
        allowlist.publish(["a", 42])  # type: ignore[list-item]
    allowlist.publish(["a"])
    with pytest.raises(RuntimeError, match="published already"):
        allowlist.publish(["os"])
    assert describable() == ("a",)


@pytest.mark.parametrize("attr", ["contextlib", "dataclasses", "enum"])
def test_an_also_name_whose_value_is_a_module_is_refused(
    gen_worker: WorkerProc, attr: str
) -> None:
    """``also`` adds names to a module's exports; a module it imports is not one (the
    describer is no way to reach another module by an attribute of an allowed one)."""
    with pytest.raises(WorkerCallError) as err:
        describe(gen_worker, "my_model", [attr])
    assert err.value.error["python_type"] == "ValueError"
    message = err.value.error["message"]
    assert f"{attr!r} (of also) is the module {attr}" in message, message


@pytest.mark.parametrize(
    "attr", ["", "os.path", "contextlib.contextmanager", "a b", "1x", "x-y", "x;os", "x\x00"]
)
def test_an_also_name_that_is_not_an_identifier_is_refused(
    gen_worker: WorkerProc, attr: str
) -> None:
    with pytest.raises(WorkerCallError) as err:
        describe(gen_worker, "my_model", ["scaled", attr])
    assert err.value.error["python_type"] == "ValueError"
    assert f"{attr!r} (of also) is not a Python identifier" in err.value.error["message"]


def test_an_also_name_of_a_value_the_module_defines_is_described(
    gen_worker: WorkerProc,
) -> None:
    """What ``also`` is for: a name the module defines but does not export."""
    plain = {a["name"] for a in describe(gen_worker, "my_model")["attributes"]}
    described = describe(gen_worker, "my_model", ["_depth"])
    assert "_depth" not in plain
    assert {a["name"] for a in described["attributes"]} == plain | {"_depth"}
