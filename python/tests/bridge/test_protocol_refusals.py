"""Values Python cannot take as they were sent are refused, named and located, never
changed and never left unanswered: map keys Python cannot hash, map keys that are equal
once decoded (a dict would keep one), nesting past msgpack's limit. The refusal carries
the request id (read from the frame's first bytes), and the worker keeps serving with its
sessions intact. Bodies are built byte by byte here, as a careless or hostile peer would.
"""

from __future__ import annotations

import itertools
import random
import struct
from typing import Any

import msgpack
import pytest
from conftest import next_id

from vllm_bridge.bridge.protocol import Atom, BadArgument, Decoder, ProtocolError, packb
from vllm_bridge.bridge.protocol.messages import peek_request_id

D = "vllm_bridge.bridge.diag"


def key_bytes(key: Any) -> bytes:
    """A map key as msgpack bytes; lists and maps too (``packb`` of a dict cannot hold
    them as keys)."""
    if isinstance(key, list):
        return _array_header(len(key)) + b"".join(key_bytes(k) for k in key)
    if isinstance(key, dict):  # {} only: a map used as a key
        return bytes([0x80 + len(key)]) + b"".join(key_bytes(k) + packb(v) for k, v in key.items())
    if isinstance(key, tuple) and any(isinstance(k, (list, dict)) for k in key):
        payload = _array_header(len(key)) + b"".join(key_bytes(k) for k in key)
        return b"\xc7" + bytes([len(payload), 2]) + payload
    return packb(key)


def _array_header(n: int) -> bytes:
    return bytes([0x90 + n]) if n < 16 else b"\xdc" + struct.pack(">H", n)


def map_bytes(pairs: list[tuple[Any, Any]]) -> bytes:
    """A msgpack map of exactly these pairs, in this order, duplicates and all."""
    head = bytes([0x80 + len(pairs)]) if len(pairs) < 16 else b"\xde" + struct.pack(">H", len(pairs))
    return head + b"".join(key_bytes(k) + packb(v) for k, v in pairs)


def call_body(rid: int, args: list[bytes], kwargs: bytes = b"\x80", session: str | None = None) -> bytes:
    """A ``call`` of diag.echo whose arguments are the given raw values."""
    return (
        b"\x97"
        + packb("call")
        + packb(rid)
        + packb(session)
        + packb(30_000)
        + packb(["m", D, "echo"])
        + _array_header(len(args))
        + b"".join(args)
        + kwargs
    )


def refused(body: bytes) -> BadArgument:
    with pytest.raises(BadArgument) as info:
        Decoder().decode(body)
    return info.value


# -- keys that collide -------------------------------------------------------------------

BOOL = "true == 1 and false == 0"
FLOAT = "a float equal to an integer is that integer"
ATOM = "an atom arrives as the string of its name"
ZERO = "0.0 and -0.0 are equal: the float zero has two signs"
REPEATED = "the key is repeated"

#: Pairs of keys equal in Python, and the reason the refusal must give, exactly.
COLLIDING = [
    (1, True, BOOL),
    (0, False, BOOL),
    (True, 1.0, BOOL),
    (1, 1.0, FLOAT),
    (0, -0.0, FLOAT),
    (2**70, float(2**70), FLOAT),
    (0.0, -0.0, ZERO),
    (Atom("a"), "a", ATOM),
    ((1, "a"), (True, Atom("a")), f"their elements 1 and true collide: {BOOL}"),
    ((1, (2.0,)), (1.0, (2,)), f"their elements 1 and 1.0 collide: {FLOAT}"),
    ((1, (0.0,)), (1, (-0.0,)), f"their elements 0.0 and -0.0 collide: {ZERO}"),
    (((Atom("b"),),), (("b",),), f"their elements :b and \"b\" collide: {ATOM}"),
    (1, 1, REPEATED),
    (2**70, 2**70, REPEATED),
    (0.5, 0.5, REPEATED),
    (-0.0, -0.0, REPEATED),
    ("a", "a", REPEATED),
    (Atom("a"), Atom("a"), REPEATED),
    (True, True, REPEATED),
    (None, None, REPEATED),
    (b"\xff", b"\xff", REPEATED),
    ((1, "a"), (1, "a"), REPEATED),
]


@pytest.mark.parametrize("a,b,why", COLLIDING, ids=[f"{a!r}-{b!r}" for a, b, _ in COLLIDING])
def test_keys_equal_in_python_are_refused_by_name_place_and_reason(a, b, why):
    arg = b"\x81" + packb("outer") + b"\x92\x00" + map_bytes([(a, "x"), (b, "y")])
    err = refused(call_body(5, [packb(1), arg]))
    text = str(err)
    assert text.startswith('could not decode args[1]["outer"][1]: the map keys ')
    assert f"are equal in Python ({why}), so a dict would keep only one of them" in text


def test_a_key_holding_a_deeply_nested_list_is_named_briefly():
    """A tuple key holding a list 600 levels deep (under msgpack's 1 024): the refusal
    names the list, not a nesting limit it did not reach."""
    payload = b"\x92\x01" + b"\x91" * 600 + b"\x01"
    key = b"\xc8" + len(payload).to_bytes(2, "big") + b"\x02" + payload
    text = str(refused(call_body(3, [b"\x81" + key + packb(1)])))
    assert text.startswith(
        "could not decode args[0]: the map key {1, [[[[[[[...]]]]]]]} holds a list"
    )
    assert "cannot hash" in text and len(text) < 400


# -- keys that cannot be hashed ----------------------------------------------------------

UNHASHABLE = [[1], [], {}, (1, [2]), (1, {})]


@pytest.mark.parametrize("key", UNHASHABLE, ids=repr)
def test_unhashable_keys_are_refused_by_name_and_place(key):
    inner = map_bytes([("fine", 1), (key, 2)])
    body = call_body(9, [packb(0)], kwargs=b"\x81" + packb("opt") + b"\x91" + inner)
    text = str(refused(body))
    assert text.startswith('could not decode kwargs["opt"][0]: the map key ')
    assert "cannot hash" in text


def test_a_bad_key_inside_a_tuple_or_dataclass_is_located():
    tup = map_bytes([([1], 2)])
    body = call_body(3, [b"\xc7" + bytes([1 + len(tup), 2]) + b"\x91" + tup])
    assert str(refused(body)).startswith("could not decode args[0][0]: the map key [1]")
    fields = b"\x83" + packb("name") + packb("s") + packb("level") + packb(None) + packb("payload") + map_bytes([(1, 0), (True, 1)])
    payload = b"\x92" + packb("vllm_bridge.bridge.diag.Sample") + fields
    body = call_body(4, [b"\xc7" + bytes([len(payload), 4]) + payload])
    assert str(refused(body)).startswith("could not decode args[0].payload: the map keys 1 and true")


def test_keys_python_keeps_apart_decode_unchanged():
    pairs = [(1, "i"), ("1", "s"), (Atom("x"), "a"), (2.5, "f"), (None, "n"), ((1, "a"), "t"), (b"\xff", "b")]
    value = Decoder().decode(call_body(2, [map_bytes(pairs)])).value
    assert value[5][0] == dict(pairs) and len(value[5][0]) == len(pairs)


# -- nesting -----------------------------------------------------------------------------


def test_nesting_past_msgpacks_limit_is_refused_naming_the_argument():
    deep = b"\x91" * 1100 + b"\x01"
    err = refused(call_body(8, [packb(1), deep]))
    assert str(err).startswith("could not decode args[1]: it nests deeper than msgpack's limit")
    deep_map = (b"\x81\xa1k") * 1100 + b"\x01"
    assert "args[0]" in str(refused(call_body(8, [deep_map])))


def test_extension_values_nest_64_levels():
    def tuples(n: int) -> bytes:
        v = packb(1)
        for _ in range(n):
            payload = b"\x91" + v
            v = msgpack.packb(msgpack.ExtType(2, payload))
        return v

    value = Decoder().decode(call_body(1, [tuples(64)])).value[5][0]
    for _ in range(64):
        value = value[0]
    assert value == 1
    assert "nest deeper than 64" in str(refused(call_body(1, [tuples(65)])))


def test_malformed_structure_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="ends in the middle"):
        Decoder().decode(call_body(1, [b"\x92\x01"], kwargs=b""))


# -- the request id, read from the first bytes -------------------------------------------


@pytest.mark.parametrize(
    "rid", [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1]
)
def test_peek_reads_the_id_of_any_size_whatever_follows(rid):
    body = call_body(rid, [map_bytes([([1], 2)])])
    assert peek_request_id(body) == rid
    assert peek_request_id(bytearray(body)) == rid
    assert peek_request_id(memoryview(body)) == rid
    long_kind = b"\x97\xd9\x04call" + packb(rid)  # a str 8 kind, then the id
    assert peek_request_id(long_kind) == rid
    array16 = b"\xdc\x00\x02" + packb("ping") + packb(rid)
    assert peek_request_id(array16) == rid


def test_peek_agrees_with_a_full_decode_on_random_messages():
    rng = random.Random(13)
    kinds = ["call", "get", "ping", "cancel", "stream", "release", "x" * 40]
    for _ in range(2000):
        rid = rng.choice([rng.randrange(128), rng.randrange(2**16), rng.randrange(2**64)])
        msg = [rng.choice(kinds), rid] + [rng.choice([None, 1, "s", [1, 2], {"a": 1}])] * rng.randrange(6)
        assert peek_request_id(packb(msg)) == rid


@pytest.mark.parametrize(
    "body",
    [b"", b"\x92", b"\x92\xa4ca", b"\x91\xa4call", b"\x81\x01\x02", b"\x92\x01\x02",
     b"\x92\xa4call\xff", b"\x92\xa4call\xc0", b"\x92\xa4call\xcd\x01", b"\xc1"],
)
def test_peek_gives_none_when_there_is_no_id_to_read(body):
    assert peek_request_id(body) is None


# -- through a real worker ---------------------------------------------------------------


def refusals() -> list[bytes]:
    """One argument of each class that Python refuses."""
    return [
        map_bytes([([1], 2)]),
        map_bytes([({}, 1)]),
        map_bytes([(1, "a"), (True, "b")]),
        map_bytes([(1, "x"), (1.0, "y")]),
        map_bytes([(Atom("a"), 1), ("a", 2)]),
        b"\x91" * 1100 + b"\x01",
        b"\x81\xa1k" * 1100 + b"\x01",
    ]


def test_every_refusal_is_answered_at_once_under_its_id_and_the_session_stays(worker):
    worker.call(D, "set_var", "kept", session="s1")
    pid = worker.hello["pid"]
    for arg in refusals():
        rid = next_id()
        worker.send_raw(call_body(rid, [arg], session="s1"))
        kind, got, err = worker.reply(rid)
        assert (kind, got, err["type"]) == ("error", rid, "bad_argument"), err
        assert err["message"].startswith("could not decode args[0]: ")
    assert worker.ping()["running"] is None
    assert worker.call(D, "get_var", session="s1") == "kept"
    assert worker.call(D, "info")["pid"] == pid
    assert worker.proc.poll() is None


def test_a_refused_request_does_not_disturb_the_ones_around_it(worker):
    ids = [next_id() for _ in range(30)]
    bad = itertools.cycle(refusals())
    for i, rid in enumerate(ids):
        if i % 3 == 1:
            worker.send_raw(call_body(rid, [next(bad)]))
        else:
            worker.send(["call", rid, None, 30_000, ["m", D, "add"], [i, 1], {}])
    for i, rid in enumerate(ids):
        reply = worker.reply(rid)
        if i % 3 == 1:
            assert reply[0] == "error" and reply[2]["type"] == "bad_argument"
        else:
            assert reply == ["ok", rid, i + 1]


def test_random_maps_of_mixed_keys_come_back_equal_or_are_refused(shared_worker):
    """Python itself is the oracle: a map of these pairs is refused exactly when a dict
    could not hold every pair (an unhashable key, or keys equal in Python)."""
    rng = random.Random(2024)
    pool: list[Any] = [0, 1, 2, True, False, 1.0, -0.0, 2.5, Atom("a"), "a", Atom("b"), "b",
                       None, "None", (1, "a"), (True, Atom("a")), b"\xff", 2**70, float(2**70)]
    unhashable: list[Any] = [[1], {}, (1, [2])]
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(1500):
        keys = rng.sample(pool, rng.randint(1, 5))
        if rng.random() < 0.1:
            keys.append(rng.choice(unhashable))
        pairs = [(k, i) for i, k in enumerate(keys)]
        rid = next_id()
        shared_worker.send_raw(call_body(rid, [map_bytes(pairs)]))
        reply = shared_worker.reply(rid)
        hashable = all(not isinstance(k, (list, dict)) and not (isinstance(k, tuple) and any(isinstance(x, list) for x in k)) for k in keys)
        if hashable and len(set(keys)) == len(keys):
            assert reply[0] == "ok", (pairs, reply)
            assert reply[2] == dict(pairs) and len(reply[2]) == len(pairs)
            outcomes["ok"] += 1
        else:
            assert reply[0] == "error" and reply[2]["type"] == "bad_argument", (pairs, reply)
            outcomes["refused"] += 1
    assert min(outcomes.values()) > 200, outcomes  # both classes were exercised
