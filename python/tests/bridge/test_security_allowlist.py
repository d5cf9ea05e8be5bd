"""The allow-list cannot be bypassed or widened (docs/SECURITY.md).

* Nothing outside the allow-list is ever imported because of a request: not as a target,
  not as the class name of an ext 4 / ext 5 value, not through a module attribute of an
  allow-listed module (a lazy module's ``__getattr__`` imports on access).
* A reference is vetted again where it is used: as a target and as an argument (also
  inside a dataclass field). Only the worker itself could have made a reference to a
  refused object, so these tests put one in a session's table by hand, in a real
  :class:`~vllm_bridge.bridge.worker.server.Worker` in this process, and send it real frames.
* What a caller can reach does not let it change the allow-list: after every attempt the
  test can think of, modules outside it are still refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from conftest import WorkerCallError, WorkerProc, next_id
from security_support import (  # noqa: F401 - w is the fixture
    ALLOW,
    D,
    FC,
    P,
    refused,
    spawn_probe_worker,
    w,
)

from vllm_bridge.bridge.protocol import Ref, packb, unpackb
from vllm_bridge.bridge.worker.server import Worker

SIDE_EFFECT = "security_probe_import"


def ext(code: int, payload: list[Any]) -> msgpack.ExtType:
    """An ext value built by hand (the package's codec would not name these classes)."""
    return msgpack.ExtType(code, packb(payload))


def echo_forged(w: WorkerProc, arg: msgpack.ExtType) -> Any:
    """``w.call(D, "echo", arg)`` in a frame msgpack packs itself: the package's own
    encoder refuses to write an ext it did not make (protocol/foreign.py)."""
    rid = next_id()
    w.send_raw(msgpack.packb(["call", rid, None, 30_000, ["m", D, "echo"], [arg], {}]))
    reply = w.reply(rid)
    if reply[0] == "error":
        raise WorkerCallError(reply[2])
    return reply[2]


@pytest.fixture
def marked(tmp_path: Path) -> Iterator[tuple[WorkerProc, Path]]:
    """A worker whose environment names a marker file that importing
    :mod:`security_probe_import` would create."""
    marker = tmp_path / "imported"
    wp = spawn_probe_worker({"SECURITY_PROBE_MARKER": str(marker)})
    try:
        yield wp, marker
    finally:
        wp.stop()


def test_a_module_outside_the_allow_list_is_never_imported(
    marked: tuple[WorkerProc, Path],
) -> None:
    w, marker = marked
    attempts = [
        lambda: w.call(SIDE_EFFECT, "anything"),
        lambda: w.get(["m", SIDE_EFFECT, "anything"]),
        lambda: echo_forged(w, ext(4, [f"{SIDE_EFFECT}.Thing", {}])),
        lambda: echo_forged(w, ext(5, [f"{SIDE_EFFECT}.Kind", "A"])),
        lambda: echo_forged(w, ext(4, [f"{P}.{SIDE_EFFECT}.Thing", {}])),
        lambda: echo_forged(w, ext(4, [f"vllm_bridge.bridge.diag.os.{SIDE_EFFECT}.X", {}])),
    ]
    for attempt in attempts:
        refused(attempt)
    assert not w.call(P, "imported", SIDE_EFFECT)
    assert not marker.exists()


def test_a_class_name_never_walks_through_a_module(w: WorkerProc) -> None:
    """``security_probe.torch._dynamo.X``: torch imports ``_dynamo`` lazily on attribute
    access; the lookup must stop at the module ``torch`` and import nothing."""
    lazy = ["torch._dynamo", "torch._inductor", "torch.onnx"]
    assert [m for m in lazy if w.call(P, "imported", m)] == []
    for name in lazy:
        tail = name.split(".", 1)[1]
        refused(lambda: echo_forged(w, ext(4, [f"{P}.torch.{tail}.Thing", {}])))
        refused(lambda: echo_forged(w, ext(5, [f"{P}.torch.{tail}.Kind", "A"])))
    assert [m for m in lazy if w.call(P, "imported", m)] == []


def test_the_allow_list_cannot_be_widened(w: WorkerProc) -> None:
    attempts = [
        lambda: w.call(D, "sys.modules.update", {}),
        lambda: w.call(P, "SYS_MODULES.update", {"os": None}),
        lambda: w.call(P, "SYS_PATH.insert", 0, "/tmp"),
        lambda: w.call(P, "BUILTINS.update", {"isinstance": None}),
        lambda: w.call(P, "DIAG_NAMESPACE.update", {"os": None}),
        lambda: w.get(["m", FC, "logger.manager.loggerDict"]),
        lambda: w.call(P, "ROOT_HANDLERS.clear"),
        lambda: w.get(["m", D, "info.__globals__"]),
        lambda: w.call(D, "set_var", w.call(P, "module", "os")),
        lambda: w.call("vllm_bridge", "PUBLIC_MODULES.__add__", ("os",)),
        lambda: w.invoke(["r", w.call(D, "count", 1), "gi_frame.f_globals.update"], [{}]),
    ]
    for attempt in attempts:
        refused(attempt)
    # What a module exposes stays its own to change (its private journal here), and
    # changing it widens nothing.
    w.call(D, "exit_log", True)
    w.call(D, "_journal.append", {"name": "os", "type": None, "message": None})
    assert w.call(D, "exit_log", True) == [{"name": "os", "type": None, "message": None}]
    assert "os" not in w.hello["modules"]
    refused(lambda: w.call("os", "getpid"))
    refused(lambda: w.call(D, "os.getpid"))
    refused(lambda: w.call(P, "SYSTEM", "true"))
    assert w.call(D, "add", 1, 2) == 3


# -- references are vetted again where they are used -------------------------------------


@pytest.fixture
def in_process() -> Iterator[Worker]:
    """The worker's own objects in this process; replies go to /dev/null."""
    worker = Worker(tuple(ALLOW), 100)
    worker.channel.fd = os.open(os.devnull, os.O_WRONLY)
    try:
        yield worker
    finally:
        os.close(worker.channel.fd)


def handle(worker: Worker, msg: list[Any], forged: bool = False) -> Any:
    """``msg``'s reply (``forged``: packed by msgpack itself, as :func:`echo_forged`)."""
    req = worker.on_frame(msgpack.packb(msg) if forged else packb(msg))
    assert req is not None
    return unpackb(b"".join(worker.dispatcher.handle(req)))


def smuggled(worker: Worker, obj: Any) -> Ref:
    """A reference to ``obj`` made by hand: no request could have made it."""
    return worker.sessions.new_ref(worker.sessions.get(None), obj)


def test_a_refused_reference_is_refused_as_an_argument(in_process: Worker) -> None:
    ref = smuggled(in_process, os)
    rid = next_id()
    reply = handle(in_process, ["call", rid, None, 30_000, ["m", D, "echo"], [ref], {}])
    assert reply[:2] == ["error", rid]
    assert reply[2]["type"] == "bad_argument"
    assert f"argument reference {ref.ref_id} (builtins.module) is the module 'os'" in (
        reply[2]["message"]
    )
    # As a keyword argument, and inside a dataclass field, the same.
    rid = next_id()
    reply = handle(in_process, ["call", rid, None, 30_000, ["m", D, "echo"], [], {"value": ref}])
    assert reply[2]["type"] == "bad_argument"
    rid = next_id()
    sample = ext(4, ["vllm_bridge.bridge.diag.Sample", {"name": "s", "payload": ref}])
    reply = handle(in_process, ["call", rid, None, 30_000, ["m", D, "echo"], [sample], {}], True)
    assert reply[2]["type"] == "bad_argument"
    assert "is the module 'os'" in reply[2]["message"]


def test_a_refused_reference_is_refused_as_a_target(in_process: Worker) -> None:
    for obj, what in ((os, "the module 'os'"), (eval, "the builtin builtins.eval")):
        ref = smuggled(in_process, obj)
        rid = next_id()
        reply = handle(in_process, ["call", rid, None, 30_000, ["r", ref, None], ["1"], {}])
        assert reply[:2] == ["error", rid]
        assert reply[2]["type"] == "bad_argument"
        assert f"reference {ref.ref_id} " in reply[2]["message"]
        assert what in reply[2]["message"]


def test_an_ordinary_reference_passes_as_an_argument(in_process: Worker) -> None:
    rid = next_id()
    reply = handle(in_process, ["call", rid, None, 30_000, ["m", D, "opaque"], [5], {}])
    ref = reply[2]
    rid = next_id()
    reply = handle(in_process, ["call", rid, None, 30_000, ["m", D, "Opaque.bump"], [ref, 2], {}])
    assert reply == ["ok", rid, 7]
