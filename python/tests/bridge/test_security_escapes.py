"""Escape attempts against the allow-list (docs/SECURITY.md), through a real worker.

Each attempt tries to reach code or state outside the allow-list without naming a dunder:
through generators, coroutines, exceptions and tracebacks, bound methods' owners, class
and instance attributes, functools/operator objects, dicts of builtins, and a user module
that imports ``os`` (python/tests/bridge/security_probe.py). Each must be refused with
``bad_argument`` naming the step (or the place in the reply) and the capability, and the
worker must go on serving. The table names, for each attempt, the guard rule that
refuses it: a path step, a reply, or the dunder name rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import WorkerProc
from security_support import D, FC, P, refused, w  # noqa: F401 - the fixture

from vllm_bridge.bridge.worker import guard_tables as t


def ref_of(w: WorkerProc, module: str, path: str, *args: Any) -> Any:
    return w.call(module, path, *args)


def step(w: WorkerProc, root: list[Any], args: list[Any] | None = None) -> Any:
    return w.invoke(root, args or [])


@dataclass
class Escape:
    name: str
    attempt: Callable[[WorkerProc], Any]
    #: Text the message must hold: the refused step, or the place in the reply.
    where: str
    reason: str


def gen_ref(w: WorkerProc) -> Any:
    return w.call(D, "count", 3)


ESCAPES = [
    # -- generators and coroutines: usable themselves, their frames and code are not --
    Escape(
        "the issue's example: a generator's frame, its builtins, eval",
        lambda w: w.invoke(["r", gen_ref(w), "gi_frame.f_builtins.get"], ["eval"]),
        "(builtins.generator).gi_frame is a builtins.frame object",
        t.INTROSPECTION,
    ),
    Escape("a generator's frame", lambda w: w.get(["r", gen_ref(w), "gi_frame"]),
           ".gi_frame is", t.INTROSPECTION),
    Escape("a generator's code", lambda w: w.get(["r", gen_ref(w), "gi_code"]),
           ".gi_code is a builtins.code object", t.INTROSPECTION),
    Escape("a generator's frame's globals",
           lambda w: w.get(["r", w.call(P, "gen"), "gi_frame.f_globals"]),
           ".gi_frame is", t.INTROSPECTION),
    Escape("an open file entered as a context manager",
           lambda w: w.call(P, "opened", via="enter"),
           "the result of security_probe.opened is a _io.TextIOWrapper object", t.OS_ACCESS),
    Escape("an open file streamed line by line", lambda w: w.stream(["m", P, "opened"], []),
           "the result of security_probe.opened is", t.OS_ACCESS),
    Escape("a coroutine's frame",
           lambda w: w.get(["r", w.call(P, "make_coroutine"), "cr_frame"]),
           ".cr_frame is", t.INTROSPECTION),
    Escape("a coroutine's code",
           lambda w: w.get(["r", w.call(P, "make_coroutine"), "cr_code"]),
           ".cr_code is", t.INTROSPECTION),
    Escape("an async generator's frame",
           lambda w: w.get(["r", w.call(P, "make_async_generator"), "ag_frame"]),
           ".ag_frame is", t.INTROSPECTION),
    Escape("an async generator's code",
           lambda w: w.get(["r", w.call(P, "make_async_generator"), "ag_code"]),
           ".ag_code is", t.INTROSPECTION),
    Escape("a stream whose chunk is a frame",
           lambda w: w.stream(["m", P, "frames"], []),
           "a chunk of stream", t.INTROSPECTION),
    # -- exceptions and tracebacks ------------------------------------------------------
    Escape("a caught exception's traceback, by name",
           lambda w: w.get(["r", w.call(P, "caught"), "__traceback__"]),
           "'__traceback__'", "no path part may start with '__'"),
    Escape("a traceback returned", lambda w: w.call(P, "traceback_of"),
           "the reply to call", t.INTROSPECTION),
    Escape("sys.exc_info() returned (a traceback inside a tuple)",
           lambda w: w.call(P, "exc_info"), "(at [2]) is a builtins.traceback object",
           t.INTROSPECTION),
    Escape("a frame returned", lambda w: w.call(P, "frame"), "the reply to call",
           t.INTROSPECTION),
    Escape("a code object returned", lambda w: w.call(P, "code"), "builtins.code object",
           t.INTROSPECTION),
    Escape("a closure cell returned", lambda w: w.call(P, "cell"), "builtins.cell object",
           t.INTROSPECTION),
    Escape("a frame held in an instance attribute",
           lambda w: w.get(["r", w.call(P, "holder"), "frame"]), ").frame is",
           t.INTROSPECTION),
    # -- bound methods' owners ----------------------------------------------------------
    Escape("a logger's addHandler returned (loggers may log, not be rewired)",
           lambda w: w.call(P, "bound_logger_method"),
           "the method logging.Logger.addHandler", t.WORKER),
    Escape("sys.stderr.write held in a global", lambda w: w.get(["m", P, "WRITE"]),
           "security_probe.WRITE is the method _io.TextIOWrapper.write", t.OS_ACCESS),
    Escape("a user logger's manager (every logger, the worker's handler)",
           lambda w: w.get(["m", P, "LOGGER.manager.loggerDict"]),
           "attribute 'manager' of security_probe.LOGGER is", t.CLOSED),
    Escape("the forward context's logger, up to the root's handlers",
           lambda w: w.get(["m", FC, "logger.root.handlers"]),
           "attribute 'root' of vllm_bridge.forward_context.logger is", t.CLOSED),
    Escape("a logger's setLevel (the worker forwards warnings through the root)",
           lambda w: w.invoke(["r", w.call(FC, "init_logger", "x"), "root.setLevel"], [50]),
           "attribute 'root' of reference", t.CLOSED),
    Escape("a logger held in a class attribute, its manager",
           lambda w: w.get(["r", w.call(P, "holder"), "log.manager"]),
           "attribute 'manager' of reference", t.CLOSED),
    Escape("the root logger's handlers, reached through init_logger('')",
           lambda w: w.get(["r", w.call(FC, "init_logger", ""), "handlers"]),
           "attribute 'handlers' of reference", t.CLOSED),
    # -- class and instance attributes ----------------------------------------------------
    Escape("a module in a class attribute", lambda w: w.call(P, "Holder.os.system", "true"),
           "security_probe.Holder.os is the module 'os'", t.FOREIGN_MODULE),
    Escape("subprocess.run in a class attribute",
           lambda w: w.call(P, "Holder.runner", ["true"]),
           "security_probe.Holder.runner is the function subprocess.run", t.OS_ACCESS),
    Escape("a staticmethod(os.system) class attribute",
           lambda w: w.call(P, "Holder.shell", "true"), "security_probe.Holder.shell is",
           t.OS_ACCESS),
    Escape("sys in an instance attribute",
           lambda w: w.get(["r", w.call(P, "holder"), "module.modules"]),
           ").module is the module 'sys'", t.FOREIGN_MODULE),
    Escape("a contextvars.Context in an instance attribute (run calls anything)",
           lambda w: w.get(["r", w.call(P, "holder"), "context.run"]), ").context is",
           t.WORKER),
    Escape("an io buffer in an instance attribute",
           lambda w: w.get(["r", w.call(P, "holder"), "buffer.read"]), ").buffer is",
           t.OS_ACCESS),
    Escape("an array attribute's tofile (writes any path)",
           lambda w: w.get(["r", w.call(P, "holder"), "array.tofile"]),
           ").array.tofile is the method numpy.ndarray.tofile", t.OS_ACCESS),
    Escape("an object array's dump (pickles to any path)",
           lambda w: w.get(["r", w.call(P, "object_array"), "dump"]), ").dump is",
           t.OS_ACCESS),
    Escape("type() of a class held by reference",
           lambda w: w.call(P, "type_of", w.call(P, "type_of", w.call(P, "holder"))),
           "the class builtins.type", t.EVALUATION),
    # -- functools and operator objects, formatting ------------------------------------------
    Escape("functools.partial(os.system)", lambda w: w.call(P, "PARTIAL_SYSTEM"),
           "security_probe.PARTIAL_SYSTEM is a functools.partial object", t.OS_ACCESS),
    Escape("operator.attrgetter", lambda w: w.call(P, "ATTRGETTER", 1),
           "security_probe.ATTRGETTER is", t.GENERIC_ACCESS),
    Escape("operator.methodcaller", lambda w: w.call(P, "METHODCALLER", 1),
           "security_probe.METHODCALLER is", t.GENERIC_ACCESS),
    Escape("an attrgetter made for the caller", lambda w: w.call(P, "getter", "__class__"),
           "the reply to call", t.GENERIC_ACCESS),
    Escape("staticmethod(os.system) in a global", lambda w: w.call(P, "STATIC_SYSTEM", "true"),
           "security_probe.STATIC_SYSTEM is", t.OS_ACCESS),
    Escape("a bound str.format (format fields walk attributes)",
           lambda w: w.call(P, "FORMAT", 1), "the method builtins.str.format",
           t.GENERIC_ACCESS),
    Escape("str.format of a string reached in vllm_bridge.bridge.diag",
           lambda w: w.call(D, "_VAR.name.format", 1), "vllm_bridge.bridge.diag._VAR.name.format is",
           t.GENERIC_ACCESS),
    Escape("string.Formatter", lambda w: w.get(["m", P, "FORMATTER.get_field"]),
           "security_probe.FORMATTER is", t.GENERIC_ACCESS),
    Escape("a weak reference", lambda w: w.call(P, "WEAK"), "security_probe.WEAK is",
           t.GENERIC_ACCESS),
    Escape("contextlib.ExitStack.callback (calls what it is given)",
           lambda w: w.get(["m", P, "STACK.callback"]), "security_probe.STACK is",
           t.GENERIC_ACCESS),
    # -- dicts of builtins, values nested in replies ------------------------------------
    Escape("the builtins namespace's get('eval')",
           lambda w: w.call(P, "BUILTINS.get", "eval"),
           "security_probe.BUILTINS is the namespace of the module 'builtins'", t.NAMESPACE),
    Escape("rewriting the builtins namespace", lambda w: w.call(P, "BUILTINS.update", {}),
           "security_probe.BUILTINS is", t.NAMESPACE),
    Escape("rewriting sys.modules", lambda w: w.call(P, "SYS_MODULES.pop", D),
           "security_probe.SYS_MODULES is sys.modules", t.NAMESPACE),
    Escape("adding to sys.path", lambda w: w.call(P, "SYS_PATH.insert", 0, "/tmp"),
           "security_probe.SYS_PATH is sys.path", t.NAMESPACE),
    Escape("os's namespace, get('system')", lambda w: w.call(P, "OS_NAMESPACE.get", "system"),
           "the namespace of the module 'os'", t.NAMESPACE),
    Escape("rewriting an allow-listed module's namespace",
           lambda w: w.call(P, "DIAG_NAMESPACE.update", {"add": None}),
           "the namespace of the module 'vllm_bridge.bridge.diag'", t.NAMESPACE),
    Escape("removing the worker's log handler", lambda w: w.call(P, "ROOT_HANDLERS.clear"),
           "security_probe.ROOT_HANDLERS is logging.root.handlers", t.WORKER),
    Escape("a copy of the builtins namespace, get('open')",
           lambda w: w.call(P, "BUILTINS_COPY.get", "open"), "the builtin io.open",
           t.OS_ACCESS),
    Escape("the builtins namespace returned by value", lambda w: w.call(P, "builtins_dict"),
           "(at ['__loader__']) is the class _frozen_importlib.BuiltinImporter", t.EVALUATION),
    Escape("a module inside a dict", lambda w: w.call(P, "MODULES.get", "os"),
           "the module 'os'", t.FOREIGN_MODULE),
    Escape("eval nested in lists and tuples", lambda w: w.call(P, "nested"),
           "(at ['items'][2][1]) is the builtin builtins.eval", t.EVALUATION),
    Escape("eval in a dataclass field", lambda w: w.call(P, "point_with_eval"),
           "(at .y) is the builtin builtins.eval", t.EVALUATION),
    # -- a user module that imports os --------------------------------------------------
    Escape("its os module", lambda w: w.call(P, "os.getpid"), "security_probe.os is",
           t.FOREIGN_MODULE),
    Escape("os.system in a global", lambda w: w.call(P, "SYSTEM", "true"),
           "security_probe.SYSTEM is the builtin posix.system", t.OS_ACCESS),
    Escape("open in a global", lambda w: w.call(P, "OPEN", "/etc/hostname"),
           "security_probe.OPEN is", t.OS_ACCESS),
    Escape("eval in a global", lambda w: w.call(P, "EVAL", "1"), "security_probe.EVAL is",
           t.EVALUATION),
    Escape("importlib.import_module in a global", lambda w: w.call(P, "IMPORT", "os"),
           "security_probe.IMPORT is", t.EVALUATION),
    Escape("pickle.loads in a global", lambda w: w.call(P, "LOADS", b"N."),
           "security_probe.LOADS is", t.EVALUATION),
    Escape("torch.load in a global", lambda w: w.call(P, "TORCH_LOAD", "/dev/null"),
           "security_probe.TORCH_LOAD is", t.OS_ACCESS),
    Escape("numpy.load in a global", lambda w: w.call(P, "NP_LOAD", "/dev/null"),
           "security_probe.NP_LOAD is", t.OS_ACCESS),
    Escape("a module returned", lambda w: w.call(P, "module", "os"),
           "the reply to call", t.FOREIGN_MODULE),
    Escape("a tensor's storage returned (from_file)", lambda w: w.call(P, "storage"),
           "torch.storage.UntypedStorage object", t.OS_ACCESS),
    # -- what vllm_bridge.bridge.diag imports -----------------------------------------------------
    Escape("diag's sys.modules", lambda w: w.get(["m", D, "sys.modules"]),
           "vllm_bridge.bridge.diag.sys is the module 'sys'", t.FOREIGN_MODULE),
    Escape("diag's logging", lambda w: w.get(["m", D, "logging.root"]),
           "vllm_bridge.bridge.diag.logging is", t.FOREIGN_MODULE),
    Escape("diag's dataclass decorator (generates code)", lambda w: w.get(["m", D, "dataclass"]),
           "the function dataclasses.dataclass", t.EVALUATION),
    Escape("diag's typing.Any", lambda w: w.get(["m", D, "Any"]), "vllm_bridge.bridge.diag.Any is",
           t.EVALUATION),
    # -- dunders stay unreachable by name ----------------------------------------------
    Escape("a function's globals", lambda w: w.get(["m", P, "gen.__globals__"]),
           "'__globals__'", "no path part may start with '__'"),
    Escape("a bound method's function",
           lambda w: w.get(["r", w.call(P, "holder"), "method.__func__"]), "'__func__'",
           "no path part may start with '__'"),
]


def test_there_are_at_least_forty_attempts() -> None:
    assert len(ESCAPES) >= 40
    assert len({e.name for e in ESCAPES}) == len(ESCAPES)


@pytest.mark.parametrize("escape", ESCAPES, ids=[e.name for e in ESCAPES])
def test_escape_is_refused(w: WorkerProc, escape: Escape) -> None:
    message = refused(lambda: escape.attempt(w))
    assert escape.where in message, message
    assert escape.reason in message, message
    # The refusal costs nothing else: the worker serves on.
    assert w.call(D, "add", 1, 2) == 3


def test_refused_reply_drops_the_references_it_made(w: WorkerProc) -> None:
    """A reply that fails on a refused value leaves no half-made reference behind."""
    before = w.ping()["refs"]
    refused(lambda: w.call(P, "mixed"))  # an Opaque-like object first, then eval
    assert w.ping()["refs"] == before


def test_nothing_ran_when_refused(w: WorkerProc, tmp_path: Any) -> None:
    """The refused callables never ran: the file each would have made is not there."""
    marker = tmp_path / "ran"
    for attempt in (
        lambda: w.call(P, "SYSTEM", f"touch {marker}"),
        lambda: w.call(P, "Holder.runner", ["touch", str(marker)]),
        lambda: w.call(P, "PARTIAL_SYSTEM"),
        lambda: w.call(P, "EVAL", f"open({str(marker)!r}, 'w')"),
        lambda: w.invoke(["r", gen_ref(w), "gi_frame.f_builtins.get"], ["exec"]),
    ):
        refused(attempt)
    assert w.call(P, "unset_marker", str(marker))
    assert not marker.exists()
