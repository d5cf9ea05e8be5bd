"""The common call's lane (vllm_bridge/bridge/worker/lane.py) answers exactly as the
general path does.

One stream of generated request frames (stdlib ``random``, fixed seeds) is run through
the execution loop of a worker with the lane and of one without (in this process, as
bench/worker_path.py runs it: frames from a file, replies to a file), and the two outputs
are compared frame by frame, byte for byte. The one allowance: a ``python_exception``'s
traceback lists the worker's own frames it passed through, which are the lane's in one
and the dispatcher's in the other (and msgpack's ``packb`` wrapper, which the lane does
not go through, for a reply that cannot be packed); those lines are dropped from both
before comparing such a pair (the frames of the code that raised, the message, type and
``exc_id`` are compared whole).

The frames mix the common call with what must leave the lane: other kinds (``get``,
``stream``, ``enter``/``exit``, ``release``, ``close``, ``ping``, ``cancel``, ``credit``,
an unknown one), bad ids, sessions (new, reused, malformed), deadlines already passed,
timeouts out of range (big integers, infinities), targets that are not one step of a
module (dotted, dunder, private, missing, off the allow-list, references), atoms converted
by annotation, tuples, dataclasses and enums, references made and used, code that raises,
results that become references, and bodies cut short, with bytes after the value, with a
reserved byte, or with a map whose keys collide. The count of requests the lane itself ran
is checked too, so the comparison is not vacuous. Cancel, liveness (pings answered by the
watcher during a long lane call), a passed deadline, sessions, log frames of lane calls
and a timeout out of range run in real worker processes (the last three tests).
"""

from __future__ import annotations

import random
import re
import struct
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from conftest import run_loop, split_frames

from vllm_bridge import PUBLIC_MODULES
from vllm_bridge.bridge.protocol.encoder import Encoder
from vllm_bridge.bridge.protocol.errors import short_repr
from vllm_bridge.bridge.protocol.registry import TypeRegistry
from vllm_bridge.bridge.protocol.types import Atom, Ref
from vllm_bridge.bridge.worker.server import Worker

HEADER = struct.Struct(">I")
DIAG = "vllm_bridge.bridge.diag"
INSTANCE = "0123456789abcdef"
#: The workers' frame limit: a reply of 80 000 characters is over it.
FRAME_LIMIT = 70_010
ENCODER = Encoder(TypeRegistry(tuple(PUBLIC_MODULES)))

# What a call names and passes: the common case and its edges.
TARGETS = [
    ["m", DIAG, "add"], ["m", DIAG, "echo"], ["m", DIAG, "set_var"], ["m", DIAG, "get_var"],
    ["m", DIAG, "opaque"], ["m", DIAG, "fail"], ["m", DIAG, "level_name"],
    ["m", DIAG, "Sample"], ["m", DIAG, "Level"], ["m", DIAG, "sleep"],
    ["m", DIAG, "Opaque.bump"], ["m", DIAG, "__name__"], ["m", DIAG, "_check_seconds"],
    ["m", DIAG, "nope"], ["m", DIAG, "os"], ["m", DIAG, ""], ["m", DIAG, "Level.HIGH"],
    ["m", "os", "getcwd"], ["m", DIAG, "_VAR"], ["m", DIAG, "dataclass"],
    ["m", "vllm_bridge.forward_context", "is_forward_context_available"],
    ["r", Ref(INSTANCE, 1, None, "x"), "bump"],
    ["r", Ref(INSTANCE, 2, "s1", "x"), None], ["m", DIAG], [Atom("m"), DIAG, "add"],
]  # fmt: skip
ARGS = [
    [], [1, 2], [1.5, 2], ["a", "b"], [[1], [2]], [(1, 2), (3,)], [Atom("high")],
    [Atom("nope")], ["boom"], ["boom", "KeyError"], [0], [2**64 + 1, 1], [None],
    [{"a": 1}], [Ref(INSTANCE, 1, None, "x")], ["n"],
]  # fmt: skip
KWARGS = [{}, {}, {}, {"a": 1, "b": 2}, {"value": 3}, {"level": Atom("low")}, {"x": 1},
          {Atom("a"): 1, "b": 2}]  # fmt: skip
SESSIONS = [None, None, None, "s1", "s2", Atom("s1"), 1, ""]
# Out of the protocol's range (2^32 - 1 ms either way) too: big integers (ext 7), which
# once went into a float on the lane, and the infinities.
TIMEOUTS = [None, None, 60_000, 0, -5, float("nan"), "5", 2**1600 - 1, -(2**1600), 2**32,
            float("inf"), float("-inf")]  # fmt: skip
IDS = ["good"] * 8 + [-1, "x", None, True, 2**64]
#: Common calls with arguments that fit: the lane's own route, to its plain reply.
PLAIN = [
    ("add", [1, 2], {}), ("add", [1.5, 2], {}), ("add", ["a", "b"], {}), ("get_var", [], {}),
    ("set_var", [7], {}), ("set_var", ["x"], {}), ("level_name", [Atom("high")], {}),
    ("add", [], {"a": 2**63, "b": 2**63}), ("echo", [None], {}), ("sleep", [0], {}),
    ("echo", ["x" * 80_000], {}),  # a plain reply over the frame limit (see run_worker)
    ("dataclass", [], {}),  # a callable of diag's namespace defined elsewhere: refused
]  # fmt: skip


def body_of(msg: Any) -> bytes:
    return b"".join(bytes(s) for s in ENCODER.encode(msg))


def mangle(body: bytes, rng: random.Random) -> bytes:
    """``body`` broken in one of the ways a peer's bytes can be."""
    roll = rng.randrange(4)
    if roll == 0:
        return body[: rng.randrange(1, len(body))]  # cut short
    if roll == 1:
        return body + b"\x01"  # a byte after the value
    if roll == 2:
        return body[:-1] + b"\xc1"  # a reserved type byte
    # kwargs whose two keys are one ("a" and "a"): the map header counts two pairs
    return body[:-1] + b"\x82\xa1a\x01\xa1a\x02"


def frames(seed: int, count: int) -> bytes:
    rng = random.Random(seed)
    out = []
    next_id = 1000
    for _ in range(count):
        next_id += 1
        rid: Any = rng.choice(IDS)
        rid = next_id if rid == "good" else rid
        session = rng.choice(SESSIONS)
        owner = session if session is None or isinstance(session, str) else None
        roll = rng.random()
        if roll < 0.6:
            msg = ["call", rid, session, rng.choice(TIMEOUTS), rng.choice(TARGETS),
                   rng.choice(ARGS), rng.choice(KWARGS)]  # fmt: skip
            if rng.random() < 0.5:  # the valid common call, more often than not
                msg[1], msg[3] = next_id, rng.choice([None, 60_000])
                msg[2] = rng.choice([None, "s1", "s2"])
                if rng.random() < 0.6:
                    name, msg[5], msg[6] = rng.choice(PLAIN)
                    msg[4] = ["m", DIAG, name]
        elif roll < 0.65:
            msg = ["get", rid, session, None, rng.choice(TARGETS)]
        elif roll < 0.7:
            msg = ["stream", rid, session, None, ["m", DIAG, "count"], [rng.randrange(4)], {}]
        elif roll < 0.75:
            msg = ["enter", rid, session, None, ["m", DIAG, "recorder"], ["lane"], {}]
        elif roll < 0.78:
            handle = Ref(INSTANCE, rng.randrange(1, 9), owner, "context")
            msg = ["exit", rid, session, None, handle, None]
        elif roll < 0.82:
            msg = ["release", rid, session, [Ref(INSTANCE, rng.randrange(1, 9), owner, "x")]]
        elif roll < 0.85:
            msg = ["close", rid, rng.choice(["s1", "s2", None])]
        elif roll < 0.9:
            msg = [rng.choice(["ping", "cancel"]), rng.choice([rid, next_id - 1])]
        elif roll < 0.93:
            msg = ["credit", rid, rng.choice([1, 0])]
        elif roll < 0.95:
            msg = ["call", rid, None, None, ["m", DIAG, "echo"],
                   [rng.choice([(1, 2), Atom("a"), 2**70])], {}]  # fmt: skip
        else:
            msg = [rng.choice(["nope", Atom("call"), 7]), rid, None]
        body = body_of(msg)
        if rng.random() < 0.1:
            body = mangle(body, rng)
        out.append(HEADER.pack(len(body)) + body)
    return b"".join(out)


def run_worker(stream: Path, out: Path, lane: bool) -> tuple[int, int]:
    """Run ``stream``'s frames through a worker's execution loop, replies to ``out``;
    returns how many requests the lane itself ran, and how many of their replies it
    packed itself (a vetted function called, a plain result)."""
    modules = tuple(PUBLIC_MODULES)
    worker = Worker(modules, 8, lane=lane)
    worker.sessions.instance = INSTANCE
    # Set after the start, as test_fast_paths.py does: read per reply, never kept.
    worker.channel.max_frame = FRAME_LIMIT
    taken = packed = 0
    if worker.lane is not None:
        through, pack = worker.lane._in_session, worker.lane._pack

        def counted(req: Any, session: Any) -> Any:
            nonlocal taken
            taken += 1
            return through(req, session)

        def counted_pack(value: Any) -> bytes:
            nonlocal packed
            packed += 1
            return pack(value)

        worker.lane._in_session = counted  # type: ignore[method-assign]
        worker.lane._pack = counted_pack  # type: ignore[method-assign]
    run_loop(worker, stream, out)
    if worker.lane is not None:
        # The lane reads the guards' verdict tables it was given: they must be the ones
        # the guards still clear (never replaced), or a verdict dropped there would stay.
        guard = worker.dispatcher.resolver.guard
        assert worker.lane._guard_passed is guard.passed
        assert worker.lane._calls_passed is guard.calls.passed
    return taken, packed


#: A traceback's entry for a frame of the worker's own code: the worker package, the
#: msgpack wrapper the general path packs a reply with (the lane calls the packer
#: itself), and this test's counting wrappers.
_WORKER_FRAME = re.compile(
    r'  File "[^"]*(/vllm_bridge/bridge/worker/[^"]*|/msgpack/__init__\.py|/test_lane\.py)", '
    r"line \d+, in \w+\n(    .*\n)*"
)


def without_worker_frames(reply: bytes) -> Any:
    msg = msgpack.unpackb(reply, strict_map_key=False)
    if msg[0] == "error" and isinstance(msg[2].get("traceback"), str):
        msg[2]["traceback"] = _WORKER_FRAME.sub("", msg[2]["traceback"])
    return msg


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_the_lane_answers_every_frame_as_the_general_path(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A clock that stands still: a passed deadline's refusal says by how much it passed
    # ("passed 5 ms before its turn came"), which a preemption between the frame's
    # receipt and its start (a loaded machine) would otherwise change in one run only.
    monkeypatch.setattr(time, "monotonic", lambda: 1000.0)
    stream = tmp_path / "frames"
    stream.write_bytes(frames(seed, 600))
    lane_out, general_out = tmp_path / "lane", tmp_path / "general"
    taken, packed = run_worker(stream, lane_out, lane=True)
    assert run_worker(stream, general_out, lane=False) == (0, 0)
    lane, general = split_frames(lane_out.read_bytes()), split_frames(general_out.read_bytes())
    assert len(lane) == len(general) > 500
    assert taken > 100 and packed > 50  # the lane ran common calls itself
    kinds = {msgpack.unpackb(g, strict_map_key=False)[0] for g in general}
    assert {"ok", "error", "pong", "chunk", "end"} <= kinds
    errors = {
        m[2]["type"] for m in (msgpack.unpackb(g, strict_map_key=False) for g in general)
        if m[0] == "error"
    }
    assert {"protocol", "bad_argument", "timeout", "python_exception"} <= errors
    for i, (a, b) in enumerate(zip(lane, general)):
        if a != b:
            assert without_worker_frames(a) == without_worker_frames(b), f"reply {i}"
            assert b'"python_exception"' in a or b"python_exception" in a, f"reply {i}"


def test_a_lane_call_logs_and_is_answered_in_a_real_worker(worker) -> None:
    # diag.log, vetted by its first call and taken by the lane from the second on: its
    # record goes out as a log frame (the fixture keeps those apart from replies).
    assert worker.call(DIAG, "log", "vetting") is None
    rid = 77
    worker.send(["call", rid, None, 60_000, ["m", DIAG, "log"], ["from the lane"], {}])
    assert worker.recv() == ["ok", rid, None]
    assert ["log", "warning", DIAG, "from the lane"] in worker.logs


def test_a_lane_call_answers_pings_is_cancelled_and_times_out_in_a_real_worker(worker) -> None:
    # The first call of a function vets it (the general path); from the second on, a
    # call of it is the lane's own route. So the long sleep below runs in the lane:
    # the watcher answers pings while it runs (naming it), a cancel interrupts it, and
    # one whose deadline passed is not started.
    assert worker.call(DIAG, "sleep", 0) == 0
    assert worker.call(DIAG, "set_var", "kept", session="lane") is None
    rid = 9001
    worker.send(["call", rid, "lane", 600_000, ["m", DIAG, "sleep"], [600], {}])
    for _ in range(10_000):
        status = worker.ping()
        if status["running"] == rid:
            break
    else:
        raise AssertionError(f"call {rid} never ran")
    assert status["running_for"] is not None
    worker.send(["cancel", rid])
    kind, got, err = worker.reply(rid)
    assert (kind, got, err["type"]) == ("error", rid, "cancelled"), err
    assert f"call {rid} was interrupted: its caller gave up" in err["message"]
    assert worker.ping()["running"] is None
    late = 9002
    kind, got, err = worker.request(["call", late, "lane", 0, ["m", DIAG, "sleep"], [600], {}])
    assert (kind, got, err["type"]) == ("error", late, "timeout"), err
    assert worker.call(DIAG, "get_var", session="lane") == "kept"
    assert worker.call(DIAG, "get_var") is None


def test_a_timeout_out_of_range_is_refused_and_the_worker_goes_on(worker) -> None:
    # The auditor's frame: a big integer (ext 7) for the timeout, which the lane once
    # divided into a float outside any handler (OverflowError: the worker exited).
    big = msgpack.ExtType(7, b"\x00" + b"\xff" * 200)  # 2**1600 - 1
    worker.send_raw(msgpack.packb(["call", 5, None, big, ["m", DIAG, "add"], [1, 2], {}]))
    for rid, timeout in ((5, None), (6, -(2**1600)), (7, 2**32), (8, float("inf"))):
        if timeout is not None:
            worker.send(["call", rid, None, timeout, ["m", DIAG, "add"], [1, 2], {}])
        kind, got, err = worker.reply(rid)
        assert (kind, got, err["type"]) == ("error", rid, "protocol"), err
        named = short_repr(2**1600 - 1 if timeout is None else timeout, 60)
        assert "call timeout must be nil or a number of milliseconds" in err["message"]
        assert named in err["message"], err["message"]
    assert worker.ping()["running"] is None
    assert worker.call(DIAG, "add", 1, 2) == 3


def test_a_timestamp_is_refused_alike_by_the_lane_and_the_general_path(tmp_path: Path) -> None:
    # msgpack decodes ext -1 to a Timestamp without the ext hook (the lane decodes with
    # msgpack itself); the protocol has no such type. The last two frames hold the bytes of
    # a timestamp's header inside other values: taken.
    ts = msgpack.Timestamp(1, 0)
    add = ["m", DIAG, "add"]
    msgs = [
        ["call", 1, None, None, add, [ts, 1], {}],
        ["call", 2, None, None, add, [], {"a": ts, "b": 1}],
        ["call", 3, None, None, add, [[1, {ts: 2}]], {}],
        ["call", 4, None, ts, add, [1, 2], {}],
        ["call", 5, None, None, add, [], {ts: 1}],
        ["call", 6, None, None, ["m", DIAG, "echo"], [b"\xd6\xff\x00\x00\x00\x01"], {}],
        ["call", 7, None, None, add, [0xD6, -1], {}],
    ]
    stream = tmp_path / "frames"
    stream.write_bytes(b"".join(HEADER.pack(len(b)) + b for b in map(msgpack.packb, msgs)))
    lane_out, general_out = tmp_path / "lane", tmp_path / "general"
    assert run_worker(stream, lane_out, lane=True)[0] == 2  # the last two, in the lane
    run_worker(stream, general_out, lane=False)
    lane, general = split_frames(lane_out.read_bytes()), split_frames(general_out.read_bytes())
    assert lane == general
    replies = [msgpack.unpackb(r, strict_map_key=False) for r in lane]
    where = ["args[0]", "kwargs[\"a\"]", "a key of args[0][1]", "timeout", "a key of kwargs"]
    for rid, (reply, at) in enumerate(zip(replies, where), 1):
        assert reply[:2] == ["error", rid] and reply[2]["type"] == "bad_argument", reply
        assert reply[2]["message"].startswith(
            f"could not decode {at}: unknown extension type code -1"
        ), reply
    assert replies[5:] == [["ok", 6, b"\xd6\xff\x00\x00\x00\x01"], ["ok", 7, 213]]
