"""Which names a path may take (python/vllm_bridge/bridge/worker/guard_steps.py, docs/SECURITY.md,
"What a path may name"), through a real worker.

* A logger handed out by ``init_logger`` offers its logging methods and a few plain
  attributes, nothing more: the review's a1.py/a2.py appended a callable to its
  ``filters`` and silenced the worker's own logging.
* A private name that only code outside the allow-list defines (enum's ``_convert_``
  and ``_member_map_``, a torch module's ``_forward_hooks``) is refused before it is read;
  the private globals of allow-listed modules, and the private attributes of their
  classes, stay reachable.
"""

from __future__ import annotations


import pytest
from conftest import WorkerProc
from security_support import D, FC, P, refused, w  # noqa: F401 - the fixture

from vllm_bridge.bridge.protocol import Ref
from vllm_bridge.bridge.worker import guard_tables as t


CLOSED = ["filters", "handlers", "_cache", "parent", "manager", "root", "filters.append",
          "handlers.clear", "_cache.clear", "addFilter", "addHandler", "removeHandler",
          "setLevel", "handle", "callHandlers", "makeRecord", "findCaller", "_log"]  # fmt: skip


@pytest.mark.parametrize("path", CLOSED)
@pytest.mark.parametrize("name", ["vllm_bridge.bridge.worker", "", "vllm_bridge.bridge.diag"],
                         ids=["the worker's", "the root", "a module's"])
def test_a_logger_offers_only_its_logging_methods(w: WorkerProc, name: str, path: str) -> None:
    logger = w.call(FC, "init_logger", name)
    message = refused(lambda: w.get(["r", logger, path]))
    first = path.split(".")[0]
    assert f"attribute {first!r} of reference {logger.ref_id} ({logger.type_name})" in message
    assert t.CLOSED in message, message


def test_the_workers_logging_is_untouched_after_the_attempts(w: WorkerProc) -> None:
    """a2.py: a filter appended to the diag logger dropped every record after it."""
    logger = w.call(FC, "init_logger", "vllm_bridge.bridge.diag")
    keep = w.get(["m", D, "_FAILURES.get"])
    for attempt in (
        lambda: w.invoke(["r", logger, "filters.append"], [keep]),
        lambda: w.invoke(["r", logger, "filters.insert"], [0, w.get(["m", D, "fail"])]),
        lambda: w.invoke(["r", logger, "addFilter"], [keep]),
    ):
        refused(attempt)
    w.logs.clear()
    w.call(D, "log", "still heard")
    assert [m[1:] for m in w.logs] == [["warning", "vllm_bridge.bridge.diag", "still heard"]]


def test_a_logger_may_log_and_be_read(w: WorkerProc) -> None:
    logger = w.call(FC, "init_logger", "security.steps")
    assert w.get(["r", logger, "name"]) == "security.steps"
    assert w.get(["r", logger, "level"]) == 0
    assert w.get(["r", logger, "propagate"]) is True
    assert w.get(["r", logger, "disabled"]) is False
    assert w.invoke(["r", logger, "getEffectiveLevel"]) == 30
    child = w.invoke(["r", logger, "getChild"], ["c"])
    assert w.get(["r", child, "name"]) == "security.steps.c"
    w.logs.clear()
    w.invoke(["r", child, "error"], ["by a caller %s"], {"exc_info": False})
    assert w.logs[-1][1:] == ["error", "security.steps.c", "by a caller %s"]


PRIVATE_ELSEWHERE = [
    ("enum's _convert_", lambda w: ["m", D, "Level._convert_"], "enum"),
    ("enum's _create_", lambda w: ["m", D, "Level._create_"], "enum"),
    ("an enum's member map (its clear breaks every lookup)",
     lambda w: ["m", D, "Level._member_map_.clear"], "enum"),
    ("an enum's value map", lambda w: ["m", D, "Level._value2member_map_"], "enum"),
    ("an enum member's _value_", lambda w: ["m", D, "Level.HIGH._value_"], "enum"),
    ("a torch module's forward hooks", lambda w: ["r", w.call(P, "make_model"), "_forward_hooks"],
     "torch.nn.modules.container.Sequential"),
    ("a torch module's _apply", lambda w: ["r", w.call(P, "make_model"), "_apply"],
     "torch.nn.modules.module.Module"),
    ("a torch module's submodule table", lambda w: ["r", w.call(P, "make_model"), "_modules"],
     "torch.nn.modules.container.Sequential"),
    ("a tensor's _nnz", lambda w: ["r", w.call(P, "sparse"), "_nnz"], "torch"),
    ("a generator's internals", lambda w: ["r", w.call(D, "count", 2), "_x"], "builtins"),
]  # fmt: skip


@pytest.mark.parametrize("case", PRIVATE_ELSEWHERE, ids=[c[0] for c in PRIVATE_ELSEWHERE])
def test_a_private_name_defined_outside_the_allow_list_is_refused(w: WorkerProc, case) -> None:
    _, target, owner = case
    message = refused(lambda: w.get(target(w)))
    assert t.PRIVATE in message, message
    assert f"(it is {owner}" in message, message
    assert w.call(D, "Level", 2).name == "HIGH"  # enum lookups still work


def test_private_names_an_allow_listed_module_defines_stay_reachable(w: WorkerProc) -> None:
    assert isinstance(w.get(["m", D, "_journal"]), list)
    assert w.get(["m", D, "_VAR.name"]) == "vllm_bridge.bridge.diag.var"
    assert w.get(["m", FC, "_forward_context"]) is None
    holder = w.call(P, "holder")
    assert w.get(["r", holder, "_private"]) == "mine"  # an attribute of its own class
    assert w.invoke(["r", holder, "_helper"]) == "mine"
    assert isinstance(w.get(["m", P, "Holder"]), Ref)
