"""Replies held while the next request is already read (Channel.hold, Executor's ``hold``):
a burst of requests is answered in fewer writes, with the same bytes in the same order;
nothing is held past a write of any thread, the worker's next wait for input, or the
watcher's next look while a request runs (so a short call's reply does not wait for a
long call read behind it); a reply that is large, in pieces, or one too many is written
at once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgpack

from vllm_bridge import PUBLIC_MODULES
from vllm_bridge.bridge.protocol import framing
from vllm_bridge.bridge.protocol.encoder import Encoder
from vllm_bridge.bridge.protocol.registry import TypeRegistry
from vllm_bridge.bridge.worker.channel import HOLD_MAX, HOLD_MAX_BYTES, Channel
from vllm_bridge.bridge.worker.server import Worker

DIAG = "vllm_bridge.bridge.diag"


class CountingOs:
    """``framing``'s ``os``, counting the writes to one fd."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.writes = 0

    def write(self, fd: int, data: Any) -> int:
        if fd == self.fd:
            self.writes += 1
        return os.write(fd, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def frames_of(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        (n,) = framing._HEADER.unpack_from(data, pos)
        out.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return out


def channel(monkeypatch) -> tuple[Channel, int, CountingOs]:
    r, w = os.pipe()
    counting = CountingOs(w)
    monkeypatch.setattr(framing, "os", counting)
    ch = Channel(Encoder(TypeRegistry(())), fd=w)
    return ch, r, counting


def test_held_replies_go_out_before_the_next_frame_in_one_write(monkeypatch) -> None:
    ch, r, counting = channel(monkeypatch)
    bodies = [msgpack.packb(["ok", i, i * 10]) for i in range(3)]
    for body in bodies:
        assert ch.hold([body])
    assert counting.writes == 0
    ch.write([msgpack.packb(["ok", 3, 30])])
    assert counting.writes == 1
    got = frames_of(os.read(r, 65536))
    assert [msgpack.unpackb(b) for b in got] == [["ok", i, i * 10] for i in range(4)]
    # A large frame after held ones: the held first, then the frame, in its own write.
    assert ch.hold([bodies[0]])
    big = msgpack.packb(["ok", 5, b"x" * 10_000])  # over HOLD_MAX_BYTES, within the pipe
    ch.write([big])
    data = b""
    while len(data) < 4 + len(bodies[0]) + 4 + len(big):
        data += os.read(r, 1 << 20)
    assert frames_of(data) == [bodies[0], big]
    ch.flush()  # nothing held: nothing written
    assert counting.writes == 3


def test_what_is_not_held(monkeypatch) -> None:
    ch, r, counting = channel(monkeypatch)
    assert not ch.hold([b"x" * HOLD_MAX_BYTES])
    assert not ch.hold([b"ab", b"cd"])
    assert not ch.hold([memoryview(b"abcd")])
    for i in range(HOLD_MAX):
        assert ch.hold([msgpack.packb(i)])
    assert not ch.hold([msgpack.packb(HOLD_MAX)])
    ch.flush()
    assert counting.writes == 1
    assert frames_of(os.read(r, 65536)) == [msgpack.packb(i) for i in range(HOLD_MAX)]
    # Once closed (the port is gone), held replies are dropped, not written.
    assert ch.hold([b"late"])
    ch.close()
    ch.flush()
    ch.write([b"later"])
    assert counting.writes == 1


def run_burst(tmp_path: Path, monkeypatch, hold: bool, calls: int) -> tuple[bytes, int]:
    """``calls`` trivial calls read in one go by a worker's execution loop: its output
    and the writes it took."""
    stream = tmp_path / "in"
    stream.write_bytes(
        b"".join(
            framing.frame_bytes(
                msgpack.packb(["call", i, None, 120_000, ["m", DIAG, "add"], [i, 1], {}])
            )
            for i in range(1, calls + 1)
        )
    )
    out = tmp_path / f"out-{hold}"
    worker = Worker(tuple(PUBLIC_MODULES), 8, hold=hold)
    worker.channel.fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    counting = CountingOs(worker.channel.fd)
    monkeypatch.setattr(framing, "os", counting)
    worker.executor._reader.fd = os.open(stream, os.O_RDONLY)
    try:
        worker.executor.run()
    finally:
        monkeypatch.undo()
        os.close(worker.executor._reader.fd)
        os.close(worker.channel.fd)
    return out.read_bytes(), counting.writes


def test_a_burst_is_answered_in_fewer_writes_with_the_same_bytes(tmp_path, monkeypatch) -> None:
    held, held_writes = run_burst(tmp_path, monkeypatch, True, 100)
    one_by_one, writes = run_burst(tmp_path, monkeypatch, False, 100)
    assert held == one_by_one
    assert [msgpack.unpackb(b) for b in frames_of(held)] == [
        ["ok", i, i + 1] for i in range(1, 101)
    ]
    assert writes == 100
    # At most HOLD_MAX replies a write (the first of each run of them is written alone
    # when it was not held: the frames were read in one go, so all but the last are).
    assert held_writes <= 100 // HOLD_MAX + 2, held_writes


def test_a_reply_held_behind_a_long_call_goes_out_while_it_runs(worker) -> None:
    # Both requests in one write: the short call's reply is made while the long call is
    # already read, so it is held; the watcher's next look sends it, long before the
    # long call ends (its sleep is 600 s: only a cancel ends it).
    short, long = 1, 2
    data = b"".join(
        framing.frame_bytes(msgpack.packb(m))
        for m in [
            ["call", short, None, 600_000, ["m", DIAG, "add"], [2, 3], {}],
            ["call", long, None, 600_000, ["m", DIAG, "sleep"], [600], {}],
        ]
    )
    os.write(worker.to_worker, data)
    assert worker.recv(timeout=60) == ["ok", short, 5]
    assert worker.ping()["running"] == long
    worker.send(["cancel", long])
    kind, got, err = worker.reply(long)
    assert (kind, got, err["type"]) == ("error", long, "cancelled"), err
