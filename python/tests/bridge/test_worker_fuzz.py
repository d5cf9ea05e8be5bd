"""Malformed and fuzzed frames: the worker answers what it can and keeps serving.

Two seeded corpora, a few thousand bodies in all: random bytes, and valid messages with
random bytes flipped, cut or inserted. After every batch the worker must answer a ping;
at the end it must still run calls. The valid seeds only use harmless diag functions (no
sleep, no unbounded stream), so a mutation that still decodes cannot hang the worker.
"""

from __future__ import annotations

import random

import torch
from conftest import next_id

from vllm_bridge.bridge.diag import Level, Sample
from vllm_bridge.bridge.protocol import Atom, Ref, packb, unpackb

D = "vllm_bridge.bridge.diag"
BATCH = 50
ERROR_TYPES = {
    "python_exception",
    "bad_argument",
    "protocol",
    "timeout",
    "cancelled",
    "session_lost",
}


def seeds(instance: str) -> list[bytes]:
    ref = Ref(instance, 1, None, "x")
    messages = [
        ["ping", 1],
        ["cancel", 2],
        ["hello", 3, {"protocol": 1}],
        ["call", 4, None, 5000, ["m", D, "add"], [40, 2], {}],
        ["call", 5, "fz", None, ["m", D, "echo"], [[1, -2.5, "s", b"b", None, True]], {}],
        ["call", 6, None, 5000, ["m", D, "echo"], [(Atom("a"), 2**70, -(2**65))], {}],
        ["call", 7, None, 5000, ["m", D, "echo"], [torch.arange(6, dtype=torch.float32)], {}],
        ["call", 8, None, 5000, ["m", D, "echo"], [Sample("n", Level.HIGH)], {}],
        ["call", 9, None, 5000, ["m", D, "level_name"], [Atom("high")], {}],
        ["get", 10, None, 5000, ["m", D, "Level.LOW"]],
        ["get", 11, None, 5000, ["r", ref, "value"]],
        ["stream", 12, "fz", 5000, ["m", D, "count"], [2], {}],
        ["enter", 13, "fz", 5000, ["m", D, "recorder"], ["f"], {}],
        ["exit", 14, "fz", 5000, ref, None],
        ["release", 15, "fz", [ref]],
        ["close", 16, "fz"],
    ]
    return [packb(m) for m in messages]


def mutate(rng: random.Random, body: bytes) -> bytes:
    data = bytearray(body)
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        pos = rng.randrange(len(data) + 1)
        if op < 0.6 and data:
            data[min(pos, len(data) - 1)] = rng.randrange(256)
        elif op < 0.8:
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        else:
            del data[pos : pos + rng.randint(1, 8)]
    return bytes(data)


def run_batches(w, bodies: list[bytes]) -> int:
    """Send ``bodies`` in batches, each followed by a ping; return the error replies seen."""
    errors = 0
    for start in range(0, len(bodies), BATCH):
        for body in bodies[start : start + BATCH]:
            w.send_raw(body)
        rid = next_id() + 1_000_000_000
        w.send(["ping", rid])
        while True:
            msg = unpackb(w.recv_raw())
            if msg[0] == "pong" and msg[1] == rid:
                break
            if msg[0] == "error":
                assert set(msg[2]) == {"type", "message", "python_type", "traceback", "exc_id"}
                assert msg[2]["type"] in ERROR_TYPES
                errors += 1
    return errors


def test_random_bytes_leave_the_worker_serving(shared_worker):
    rng = random.Random(20240601)
    bodies = [bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))) for _ in range(2000)]
    errors = run_batches(shared_worker, bodies)
    assert errors > 1500  # nearly every random body is refused with an error reply
    assert shared_worker.call(D, "add", 1, 2) == 3


def test_mutated_messages_leave_the_worker_serving(shared_worker):
    rng = random.Random(7)
    corpus = seeds(shared_worker.hello["instance"])
    bodies = [mutate(rng, rng.choice(corpus)) for _ in range(2000)]
    errors = run_batches(shared_worker, bodies)
    assert errors > 500
    # Drain whatever the queued requests still answer, then check the worker works.
    assert shared_worker.call(D, "add", 2, 2, timeout=None) == 4
    status = shared_worker.ping()
    assert status["queued"] == 0
