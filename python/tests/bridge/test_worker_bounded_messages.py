"""Messages stay bounded, and so every refusal fits in a frame and is answered under its
id (docs/PROTOCOL.md, "Frame size"). The review's a7.py: a 30 000-byte atom that is not
UTF-8, under ``--max-frame-bytes 65536``, was written whole (four times over, as a repr)
into the refusal, which then did not fit, and came back as ``protocol`` "frame not
handled" instead of ``bad_argument``.

Each request below carries a value of about 40 000 bytes in the place a refusal names; the
worker's frames are limited to 64 KiB. Every refusal must be the right type, under the
right id, with a message of at most a few hundred characters; a log record or an error
message over a frame is cut to fit and says so.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
from conftest import WorkerProc, next_id, spawn_worker

from vllm_bridge.bridge.protocol import Encoder, TypeRegistry, packb, unpackb
from vllm_bridge.bridge.protocol.framing import read_frame
from vllm_bridge.bridge.worker.channel import Channel

D = "vllm_bridge.bridge.diag"
FC = "vllm_bridge.forward_context"
LIMIT = 65536
BIG = 40_000
MESSAGE_BOUND = 600


@pytest.fixture(scope="module")
def w() -> Iterator[WorkerProc]:
    wp = spawn_worker(["--max-frame-bytes", str(LIMIT), "--allow", D, FC])
    try:
        yield wp
    finally:
        wp.stop()


def ext(code: int, payload: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(code, payload)


def call_of(rid: int, args: list[Any], target: Any = None) -> bytes:
    return msgpack.packb(["call", rid, None, 30_000, target or ["m", D, "echo"], args, {}])


LONG = "n" * BIG
BODIES: list[tuple[str, Callable[[int], bytes], str]] = [
    ("an atom that is not UTF-8", lambda rid: call_of(rid, [ext(1, b"\xff" * BIG)]),
     "bad_argument"),
    ("a tuple payload that is not an array",
     lambda rid: call_of(rid, [ext(2, msgpack.packb(LONG))]), "bad_argument"),
    ("a malformed dataclass payload", lambda rid: call_of(rid, [ext(4, msgpack.packb([LONG]))]),
     "bad_argument"),
    ("a malformed enum payload", lambda rid: call_of(rid, [ext(5, msgpack.packb([LONG, 1]))]),
     "bad_argument"),
    ("a malformed reference", lambda rid: call_of(rid, [ext(6, msgpack.packb([LONG, 1, None, 2]))]),
     "bad_argument"),
    ("a reference payload of the wrong shape",
     lambda rid: call_of(rid, [ext(6, msgpack.packb([LONG]))]), "bad_argument"),
    ("a big integer with a bad sign byte", lambda rid: call_of(rid, [ext(7, b"\x05" * BIG)]),
     "bad_argument"),
    ("an unknown class name", lambda rid: call_of(rid, [ext(4, msgpack.packb([LONG, {}]))]),
     "bad_argument"),
    ("an enum member that is not there",
     lambda rid: call_of(rid, [ext(5, msgpack.packb(["vllm_bridge.bridge.diag.Level", LONG]))]),
     "bad_argument"),
    ("a dataclass field that is not there",
     lambda rid: call_of(rid, [ext(4, msgpack.packb(["vllm_bridge.bridge.diag.Sample", {LONG: 1}]))]),
     "bad_argument"),
    ("a dataclass its constructor refuses",
     lambda rid: call_of(rid, [ext(4, msgpack.packb(["vllm_bridge.bridge.diag.Sample", {"name": [LONG]}]))]),
     "bad_argument"),
    ("args that are not an array",
     lambda rid: msgpack.packb(["call", rid, None, 30_000, ["m", D, "echo"], LONG, {}]), "protocol"),
    ("kwargs with a key that is not a str",
     lambda rid: msgpack.packb(["call", rid, None, 30_000, ["m", D, "echo"], [], {1: LONG}]),
     "protocol"),
    ("a session that is not a str",
     lambda rid: msgpack.packb(["call", rid, [LONG], 30_000, ["m", D, "echo"], [], {}]), "protocol"),
    ("a malformed target", lambda rid: msgpack.packb(["call", rid, None, 30_000, [LONG], [], {}]),
     "protocol"),
    ("a timeout that is not a number",
     lambda rid: msgpack.packb(["call", rid, None, LONG, ["m", D, "echo"], [], {}]), "protocol"),
    ("a module outside the allow-list", lambda rid: call_of(rid, [], ["m", LONG, "x"]),
     "bad_argument"),
    ("an attribute that is not there", lambda rid: call_of(rid, [], ["m", D, LONG]),
     "bad_argument"),
]  # fmt: skip


@pytest.mark.parametrize("case", BODIES, ids=[c[0] for c in BODIES])
def test_a_refusal_names_a_long_value_briefly_and_is_answered(w: WorkerProc, case: Any) -> None:
    _, body_of, error_type = case
    rid = next_id()
    body = body_of(rid)
    assert BIG < len(body) < LIMIT
    w.send_raw(body)
    kind, got, err = w.reply(rid)
    assert (kind, got, err["type"]) == ("error", rid, error_type), err
    assert len(err["message"]) <= MESSAGE_BOUND, err["message"][:300]
    assert w.call(D, "add", 1, 2) == 3


def test_a_log_record_over_a_frame_is_cut_to_fit(w: WorkerProc) -> None:
    # The record is made in the worker (a request that large would be over the limit
    # itself): "%0131072d" % 7 is 131 072 characters.
    logger = w.call(FC, "init_logger", "security.bounded")
    w.logs.clear()
    assert w.invoke(["r", logger, "warning"], [f"%0{LIMIT * 2}d", 7]) is None
    [(_, level, name, message)] = w.logs
    assert (level, name) == ("warning", "security.bounded")
    assert message.startswith("0" * 1000)
    assert "[cut: the log record was " in message
    assert message.endswith(f"over the frame limit of {LIMIT} bytes (max_frame_bytes)]")
    # A logger whose long name fills the frame: the name is cut too.
    logger = w.call(FC, "init_logger", "n" * (LIMIT - 1000))
    w.logs.clear()
    assert w.invoke(["r", logger, "warning"], ["%02000d", 1]) is None
    [(_, level, name, message)] = w.logs
    assert name == "n" * 200 and message.startswith("0" * 1999 + "1 [cut: ")
    assert w.call(D, "add", 1, 2) == 3


def test_an_error_message_over_a_frame_is_cut_to_fit() -> None:
    """In process, on a real pipe: ``Channel.error`` cuts as the dispatcher's errors are
    cut (refusals made while a frame is read go this way)."""
    read_fd, write_fd = os.pipe()
    try:
        channel = Channel(Encoder(TypeRegistry(())), fd=write_fd, max_frame=LIMIT)
        channel.error(7, "bad_argument", "y" * (LIMIT * 2))
        kind, rid, err = unpackb(bytes(read_frame(fd=read_fd)))
    finally:
        os.close(read_fd)
        os.close(write_fd)
    assert (kind, rid, err["type"]) == ("error", 7, "bad_argument")
    assert err["message"].startswith("y" * 2000 + " [cut: the error reply was ")
    assert len(packb(err)) < LIMIT
