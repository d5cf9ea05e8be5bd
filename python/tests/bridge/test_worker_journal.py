"""The worker's journal of exceptions (``Sessions.record``, kept for ``exit``) keeps each
exception, its traceback's lines and its chain, but not the locals of the frames it went
through: a failed call's arguments are let go once the request has ended. A large tensor
argument maps an argument slot that goes back to the BEAM only once the tensor is gone;
before, every failed call with one held its slot for as long as the journal kept the
exception (64 per session), and 8 of them held every argument slot of the BEAM."""

from __future__ import annotations

import inspect
import itertools
import os
import sys
import traceback
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from conftest import next_id, spawn_worker
from journal_support import HOWS, Failure, fail

from vllm_bridge.bridge.protocol import packb
from vllm_bridge.bridge.protocol.slots import slot_payload
from vllm_bridge.bridge.protocol.tensors import tensor_parts
from vllm_bridge.bridge.worker import sessions as sessions_module
from vllm_bridge.bridge.worker.sessions import Sessions

MIN = 1024  # the workers' slot threshold here: small tensors, little data moved


class Big:
    """An argument whose life a weak reference watches."""


def run_request(sessions: Sessions, value: Any, how: str, depth: int) -> None:
    """The worker's shape around a failing call: a loop's request (`_execute`), the
    frame that catches and records (`_in_session`), the call through a helper
    (`Interruptible.call`); the journal lets go once all of them have ended."""

    def in_session(request: dict[str, Any]) -> None:
        args = request["args"]
        try:
            call(fail, *args)
        except BaseException as exc:  # noqa: BLE001 - as the dispatcher
            sessions.record(sessions.get(request["session"]), exc)

    def call(fn: Any, *args: Any) -> Any:
        return fn(*args)

    def execute(request: dict[str, Any]) -> None:
        in_session(request)

    execute({"args": [value, how, depth], "session": None})


def formatted(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


# Before 3.11 a generator's frame is never cleared (sessions._at_yield): a failure raised
# through a generator keeps its locals there, the price of never closing a live one.
_KEPT_BEFORE_311 = pytest.mark.xfail(
    sys.version_info < (3, 11),
    reason="before 3.11 a generator's frame is never cleared (sessions._at_yield)",
    strict=True,
)


@pytest.mark.parametrize(
    "how, depth",
    [
        pytest.param(how, depth, marks=_KEPT_BEFORE_311 if how == "through_generator" else ())
        for how, depth in itertools.product(HOWS, [0, 1, 3])
    ],
)
def test_a_recorded_failure_lets_go_of_its_arguments_and_keeps_its_lines(how, depth):
    sessions = Sessions("0" * 16, 100)
    big = Big()
    alive = weakref.ref(big)
    run_request(sessions, big, how, depth)
    del big
    (exc,) = sessions.get(None).exceptions.values()
    before = formatted(exc)
    chain = (type(exc), str(exc), exc.__cause__, exc.__context__)
    assert alive() is not None  # held by the journal's frames until the release

    sessions.release_locals()

    assert alive() is None, f"{how} at depth {depth}: the argument is still held"
    # The exception, its chain and its traceback's lines are as they were.
    assert formatted(exc) == before
    assert (type(exc), str(exc), exc.__cause__, exc.__context__) == chain
    assert isinstance(exc, Failure) and "journal_support.py" in before
    sessions.release_locals()  # nothing left to do: no error


def raise_record_and_release(caught: BaseException) -> None:
    """Raises ``caught`` here (its traceback goes on from the generator's frame), records it
    as the worker records a failure, and lets go of its frames' locals."""
    sessions = Sessions("0" * 16, 100)
    try:
        raise caught
    except Failure as exc:
        sessions.record(sessions.get("s"), exc)
    sessions.release_locals()


def test_a_suspended_generator_in_a_kept_traceback_is_not_closed():
    """An exception caught inside a generator that lives on, then raised elsewhere: its
    traceback holds the generator's suspended frame, which must not be cleared (that
    would close the generator, running its cleanup)."""
    cleaned: list[str] = []

    def keeper() -> Iterator[Any]:
        try:
            try:
                raise Failure("caught inside")
            except Failure as exc:
                yield exc
            yield "resumed"
        finally:
            cleaned.append("closed")

    gen = keeper()
    caught = next(gen)
    raise_record_and_release(caught)
    assert inspect.getgeneratorstate(gen) == inspect.GEN_SUSPENDED
    assert cleaned == []
    assert next(gen) == "resumed"


@pytest.mark.parametrize("before_311", [False, True])
def test_a_generator_paused_in_yield_from_is_not_closed(monkeypatch, before_311):
    """The same, the generator paused in ``yield from`` (where 3.10 shows its last
    instruction before the yield): not closed, whether the frame's last instruction is
    read (3.11 on) or every generator's frame counts as suspended (the rule before 3.11,
    patched in). On 3.11 this cannot show 3.10's own bytecode; it holds the rule that
    3.10 runs under to never clearing a generator's frame."""
    monkeypatch.setattr(sessions_module, "_BEFORE_311", before_311)
    cleaned: list[str] = []

    def inner() -> Iterator[str]:
        yield "paused"
        yield "resumed"

    def keeper() -> Iterator[Any]:
        try:
            try:
                raise Failure("caught inside")
            except Failure as exc:
                kept = exc
            yield kept
            yield from inner()
        finally:
            cleaned.append("closed")

    gen = keeper()
    caught = next(gen)
    assert next(gen) == "paused"
    raise_record_and_release(caught)
    assert inspect.getgeneratorstate(gen) == inspect.GEN_SUSPENDED
    assert cleaned == []
    assert next(gen) == "resumed"


# -- a real worker: the argument slot goes back ------------------------------------------------


def ext8(t: torch.Tensor, name: str) -> bytes:
    header, _ = tensor_parts(t)
    return msgpack.packb(msgpack.ExtType(8, slot_payload(header, name)))


def test_failed_calls_hand_their_argument_slots_back(slot_root: Path):
    wp = spawn_worker(
        ["--allow", "journal_support", "vllm_bridge.bridge.diag"],
        support=True,
        env={"VLLM_BRIDGE_SHM_DIR": str(slot_root), "VLLM_BRIDGE_SHM_MIN_BYTES": str(MIN)},
    )

    def call(session: str | None, target: bytes, args: list[bytes]) -> list[Any]:
        rid = next_id()
        head = b"\x97" + packb("call") + packb(rid) + packb(session) + packb(30_000)
        body = bytes([0x90 + len(args)]) + b"".join(args) + b"\x80"
        wp.send_raw(head + target + body)
        reply = msgpack.unpackb(wp.recv_raw(), raw=False, strict_map_key=False)
        assert reply[1] == rid
        return reply

    failing = packb(["m", "journal_support", "fail"])
    add = packb(["m", "vllm_bridge.bridge.diag", "add"])
    try:
        t = torch.arange(4096, dtype=torch.float32)
        cases = list(itertools.product(HOWS, [None, "journal-s"], [0, 2]))
        for n, (how, session, depth) in enumerate(cases):
            name = f"e-{n}"
            (slot_root / name).write_bytes(t.numpy().tobytes())
            kind, _, err = call(session, failing, [ext8(t, name), packb(how), packb(depth)])
            assert (kind, err["type"]) == ("error", "python_exception"), err
            assert "journal_support.py" in err["traceback"]
            # The next request runs after that one has ended on the same thread: by its
            # reply the failed call's argument is gone, and its slot handed back.
            assert call(session, add, [packb(1), packb(2)])[2] == 3
            assert (slot_root / f"{name}.free").exists(), (how, session, depth, os.listdir(slot_root))
        assert not [n for n in os.listdir(slot_root) if ".held-" in n], os.listdir(slot_root)
        # The journal still has them: an exit in that session could pass the real one.
        assert err.get("exc_id") is not None
    finally:
        wp.stop()
