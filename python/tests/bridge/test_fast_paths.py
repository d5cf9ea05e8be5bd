"""The worker's two Python fast paths answer exactly as their general paths, over
generated inputs (stdlib ``random`` with fixed seeds).

* ``messages.plain_call``, taken by :func:`parse_request` for a 7-field ``call``: the
  request it builds (every field, with its type) or the error it leads to is what
  :func:`parse_checked`, which checks every field, gives for the same message.
* ``Dispatcher._reply``'s branch for a plain scalar (msgpack packs it directly): the reply
  bytes, or the error (over the frame limit, unencodable text), are what the encoder's
  path, ``Dispatcher._encode_reply``, gives, and neither leaves a reference behind.

The inputs mix the common case with the edges that make the general path differ: atoms
(``str`` subclasses) for the kind, session, target parts and keys, booleans and floats
where ints go, NaN and infinite timeouts, integers at the 64-bit bounds, tuples for lists,
text that is not valid UTF-8, values over the frame limit. bench/fast_paths.py measures
what each fast path saves (figures in bench/results/python-worker.md, "fast_paths.py").
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from vllm_bridge import PUBLIC_MODULES
from vllm_bridge.bridge.protocol import messages
from vllm_bridge.bridge.protocol.errors import short_repr
from vllm_bridge.bridge.protocol.types import Atom, Ref
from vllm_bridge.bridge.worker.server import Worker

REF = Ref("00" * 8, 3, None, "builtins.object")
NAN = float("nan")

RIDS = [0, 1, 7, 2**31, 2**63, 2**64 - 1, 2**64, -1, True, False, 1.0, "1", None, Atom("a")]
SESSIONS = [None, "s1", "", Atom("s1"), 1, b"s", True, ["s"]]
TIMEOUTS = [None, 0, 5000, -5, 1.5, 0.0, NAN, float("inf"), float("-inf"), True, False,
            "5", 2**63, [5]]  # fmt: skip
TARGETS = [
    ["m", "vllm_bridge.bridge.diag", "add"], ["m", "mod", ""], ["m", Atom("mod"), "p"],
    ["m", "mod", Atom("p")], [Atom("m"), "mod", "p"], ["r", REF, None], ["r", REF, "x"],
    ["m", "mod"], ["m", "mod", "p", "q"], ("m", "mod", "p"), ["m", 1, "p"], ["x", "mod", "p"],
    ["m", "mod", b"p"], ["r", "notref", None], "m", None,
]  # fmt: skip
ARGS = [[], [1, 2], [[1], {"a": 1}], (1,), None, {}, "ab", [REF]]
KWARGS = [{}, {"a": 1}, {Atom("a"): 1}, {"a": 1, "b": [2]}, {1: 2}, {"a": 1, 2: 3}, [], None,
          {b"a": 1}]  # fmt: skip
KINDS = ["call", Atom("call")]


def shape(value: Any) -> Any:
    """``value`` with every type spelled out, so that equal shapes mean the same values
    of the same types (NaN compares by its text)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [(f.name, shape(getattr(value, f.name))) for f in dataclasses.fields(value)]
        return (type(value).__name__, fields)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [shape(v) for v in value])
    if isinstance(value, dict):
        return ("dict", [(shape(k), shape(v)) for k, v in value.items()])
    if isinstance(value, float):
        return ("float", repr(value))
    return (type(value).__name__, value)


def outcome(fn: Any) -> Any:
    try:
        return ("ok", shape(fn()))
    except Exception as exc:  # noqa: BLE001 - the error is what is compared
        return ("error", type(exc).__name__, str(exc), getattr(exc, "request_id", None))


def call_messages(seed: int, count: int) -> list[list[Any]]:
    rng = random.Random(seed)
    found = []
    for _ in range(count):
        msg = [rng.choice(KINDS), rng.choice(RIDS), rng.choice(SESSIONS), rng.choice(TIMEOUTS),
               rng.choice(TARGETS), rng.choice(ARGS), rng.choice(KWARGS)]  # fmt: skip
        roll = rng.random()
        if roll < 0.7:  # the rest valid, or valid but for one field: so each edge counts
            msg[1:] = [rng.choice(RIDS[:5]), rng.choice(SESSIONS[:4]), rng.choice(TIMEOUTS[:6]),
                       rng.choice(TARGETS[:7]), rng.choice(ARGS[:3]), rng.choice(KWARGS[:4])]
        if 0.35 < roll < 0.7:
            i = rng.randrange(1, 7)
            msg[i] = rng.choice([RIDS, SESSIONS, TIMEOUTS, TARGETS, ARGS, KWARGS][i - 1])
        found.append(msg)
    return found


@pytest.mark.parametrize("seed", range(8))
def testplain_call_parses_as_the_checked_path(seed: int) -> None:
    msgs = call_messages(seed, 500)
    now = 1000.0 + seed
    fast_taken = 0
    for msg in msgs:
        fast = outcome(lambda: messages.parse_request(msg, now))
        general = outcome(lambda: messages.parse_checked(msg, now))
        assert fast == general, msg
        fast_taken += messages.plain_call(msg, now) is not None
    # The fast path was taken, and passed over, often enough for the comparison to count.
    assert 50 < fast_taken < len(msgs) - 50, fast_taken


def testplain_call_on_its_edges() -> None:
    """The cases the general path turns into another type: each agrees all the same."""
    now = 5.0
    for msg in (
        [Atom("call"), 1, None, None, ["m", "mod", "p"], [], {}],
        ["call", 1, Atom("s"), None, ["m", "mod", "p"], [], {}],
        ["call", 1, None, None, ["m", Atom("mod"), Atom("p")], [], {}],
        ["call", 1, None, True, ["m", "mod", "p"], [], {}],
        ["call", 1, None, NAN, ["m", "mod", "p"], [], {}],
        ["call", 2**64, None, None, ["m", "mod", "p"], [], {}],
        ["call", 1, None, None, ["m", "mod", "p"], [], {Atom("k"): 1}],
    ):
        assert outcome(lambda: messages.parse_request(msg, now)) == outcome(
            lambda: messages.parse_checked(msg, now)
        ), msg


#: The longest timeout either way: the BEAM's longest wait, 2^32 - 1 ms.
MAX_MS = 4_294_967_295


@pytest.mark.parametrize(
    "timeout",
    [MAX_MS + 1, -MAX_MS - 1, MAX_MS + 0.5, 2**1600 - 1, -(2**1600), 1e300, float("inf"),
     float("-inf"), NAN],
    ids=lambda t: short_repr(t, 12),
)  # fmt: skip
def test_a_timeout_out_of_range_is_refused_by_both_paths_naming_it(timeout: Any) -> None:
    # Out of range for the common call's path too (it once divided a big integer into a
    # float: OverflowError, outside any handler on the worker's lane).
    msg = ["call", 5, None, timeout, ["m", "mod", "p"], [], {}]
    assert messages.plain_call(msg, 5.0) is None
    for parse in (messages.parse_request, messages.parse_checked):
        with pytest.raises(messages.RequestError) as info:
            parse(msg, 5.0)
        assert info.value.request_id == 5
        assert short_repr(timeout, 60) in str(info.value)
        assert f"at most {MAX_MS}" in str(info.value)


@pytest.mark.parametrize("timeout", [MAX_MS, -MAX_MS, float(MAX_MS), 0, -0.0, 1.5])
def test_a_timeout_at_the_ends_of_the_range_is_taken_by_both_paths(timeout: Any) -> None:
    msg = ["call", 5, None, timeout, ["m", "mod", "p"], [], {}]
    fast = messages.plain_call(msg, 5.0)
    assert fast is not None and fast.deadline == 5.0 + timeout / 1000.0
    assert fast == messages.parse_checked(msg, 5.0)


@pytest.fixture(scope="module")
def worker() -> Worker:
    modules = tuple(PUBLIC_MODULES)
    return Worker(modules, 100)


def reply_values(seed: int, count: int) -> list[Any]:
    rng = random.Random(seed)
    pools: list[list[Any]] = [
        [None, True, False],
        [0, 1, -1, 127, 128, -32, -33, 2**31, 2**32, -(2**63), -(2**63) - 1, 2**63,
         2**64 - 1, 2**64, 2**70],
        [0.0, -0.0, 1.5, -2.25, NAN, float("inf"), float("-inf"), 1e308, 5e-324],
        ["", "ok", "é€😀", "x" * 31, "x" * 32, "x" * 255, "x" * 256, "x" * 70_000, "\ud800",
         Atom("ok")],
        [b"", b"ab", [1], (1,), {"a": 1}, [None, 2.5]],  # the encoder's path in both
    ]  # fmt: skip
    return [rng.choice(rng.choice(pools)) for _ in range(count)]


def reply_outcome(fn: Any) -> Any:
    try:
        return ("ok", b"".join(bytes(s) for s in fn()))
    except Exception as exc:  # noqa: BLE001 - the error is what is compared
        return ("error", type(exc).__name__, str(exc))


@pytest.mark.parametrize("seed", range(6))
def test_reply_encodes_as_the_encoder_path(worker: Worker, seed: int) -> None:
    rng = random.Random(1000 + seed)
    d = worker.dispatcher
    session = worker.sessions.get(f"fast-{seed}")
    saved = worker.channel.max_frame
    try:
        plain = 0
        for value in reply_values(seed, 400):
            # A frame limit now and then that the larger values exceed.
            worker.channel.max_frame = rng.choice([saved, 64, 300, 70_010])
            req = messages.parse_request(["call", rng.choice([0, 9, 2**40]), None, None,
                                          ["m", "vllm_bridge.bridge.diag", "add"], [], {}], 0.0)
            kind = rng.choice(["ok", "chunk"])
            fast = reply_outcome(lambda: d._reply(req, session, kind, value))
            general = reply_outcome(lambda: d._encode_reply(req, session, kind, value))
            assert fast == general, (value if not isinstance(value, str) else value[:40], kind)
            t = type(value)
            plain += t in (bool, float, str, type(None)) or (
                t is int and -(2**63) <= value < 2**64
            )
        assert len(session.refs) == 0  # the fast path made none; the general path's failed
        assert 100 < plain < 380, plain
    finally:
        worker.channel.max_frame = saved
