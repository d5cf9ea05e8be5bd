"""Bounded frames (``--max-frame-bytes``), against real worker processes: a header that
declares more than the limit ends the worker, as a broken stream does, without the
declared length ever being allocated; a large frame takes memory only as its bytes
arrive; frames up to the limit work; a reply over the limit is refused, naming its size
and the limit, and the references made for it are dropped."""

from __future__ import annotations

import os
import select
import struct
import subprocess
import time

import pytest

from conftest import WorkerCallError, next_id, spawn_worker
from vllm_bridge.bridge.protocol import packb, unpackb
from vllm_bridge.bridge.protocol.encoder import Encoder, segments_length
from vllm_bridge.bridge.protocol.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    FrameReader,
    FrameTooLarge,
    read_frame,
)
from vllm_bridge.bridge.protocol.messages import parse_request
from vllm_bridge.bridge.protocol.registry import TypeRegistry
from vllm_bridge.bridge.worker.channel import Channel
from vllm_bridge.bridge.worker.dispatch import Dispatcher
from vllm_bridge.bridge.worker.server import parse_args
from vllm_bridge.bridge.worker.sessions import Sessions
from vllm_bridge.bridge.worker.targets import TargetResolver

MiB = 1 << 20
D = "vllm_bridge.bridge.diag"


def _status_kib(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"{field} not in /proc/{pid}/status")


def _reap(proc: subprocess.Popen, timeout: float = 60.0) -> tuple[int, int]:
    """Wait for ``proc`` to exit: its exit status and its peak resident size in bytes over
    its whole life (``wait4``'s ``ru_maxrss``, in KiB on Linux)."""
    end = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss * 1024
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError(f"the worker did not exit within {timeout} s")
        time.sleep(0.02)


def _call_body(rid: int, payload: bytes, module: str = D, fun: str = "echo") -> bytes:
    return packb(["call", rid, None, 60_000, ["m", module, fun], [payload], {}])


def _body_of_size(size: int, rid: int) -> bytes:
    """A ``diag.echo`` call whose body is exactly ``size`` bytes (a bin argument)."""
    overhead = len(_call_body(rid, b"\0" * (size // 2))) - size // 2
    body = _call_body(rid, b"\x07" * (size - overhead))
    if len(body) != size:
        raise ValueError(f"could not build a body of {size} bytes (got {len(body)})")
    return body


def _stderr_text(proc: subprocess.Popen) -> str:
    assert proc.stderr is not None
    return proc.stderr.read().decode(errors="replace")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# -- a header over the limit -------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "declared", "limit"),
    [
        ([], 0xFFFF_FFFF, DEFAULT_MAX_FRAME_BYTES),  # 4 GiB - 1 against the default 1 GiB
        (["--max-frame-bytes", str(512 * MiB)], 512 * MiB + 1, 512 * MiB),  # one byte over
    ],
    ids=["4GiB", "one-byte-over"],
)
def test_a_header_over_the_limit_ends_the_worker_without_allocating_it(
    args: list[str], declared: int, limit: int
) -> None:
    wp = spawn_worker([*args, "--allow", D], stderr=subprocess.PIPE)
    try:
        assert wp.hello["max_frame_bytes"] == limit
        assert wp.call(D, "add", 1, 2) == 3
        peak_before = _status_kib(wp.proc.pid, "VmHWM") * 1024
        # The header, then a ping: it is read as the start of the body, never answered.
        _write_all(wp.to_worker, struct.pack(">I", declared) + packb(["ping", next_id()]))
        status, peak = _reap(wp.proc)
        # Ends as on a broken stream (as on EOF: status 0) ...
        assert status == 0
        # ... without memory for the declared length: the peak grew by far less.
        assert peak - peak_before < 64 * MiB, (peak_before, peak)
        err = _stderr_text(wp.proc)
        assert (
            f"input stream broken: a frame header declares {declared} bytes, over the "
            f"limit of {limit} bytes (max_frame_bytes)"
        ) in err
        # Nothing answered the ping behind the header.
        ready, _, _ = select.select([wp.from_worker], [], [], 0)
        if ready:
            assert read_frame(wp.from_worker) is None
    finally:
        wp.stop()


def test_a_header_over_the_limit_behind_a_frame_is_refused_while_a_call_runs() -> None:
    """The watcher reads a ping and the bad header in one read: it answers the ping, then
    finds the buffered header over the limit without waiting for more bytes."""
    wp = spawn_worker(["--allow", D], stderr=subprocess.PIPE)
    try:
        rid = next_id()
        wp.send(["call", rid, None, 60_000, ["m", D, "sleep"], [3.0], {}])
        deadline = time.monotonic() + 30
        while wp.ping()["running"] != rid:
            assert time.monotonic() < deadline, "the sleep call never ran"
        ping_id = next_id()
        _write_all(
            wp.to_worker,
            struct.pack(">I", len(packb(["ping", ping_id])))
            + packb(["ping", ping_id])
            + struct.pack(">I", 0xFFFF_FFFF),
        )
        kind, got, _status = wp.take(lambda m: m[0] == "pong" and m[1] == ping_id)
        assert (kind, got) == ("pong", ping_id)
        status, _peak = _reap(wp.proc)
        assert status == 0
        assert "a frame header declares 4294967295 bytes" in _stderr_text(wp.proc)
    finally:
        wp.stop()


def test_frame_reader_refuses_a_buffered_header_over_its_limit() -> None:
    r, w = os.pipe()
    try:
        os.write(w, struct.pack(">I", 5) + b"hello" + struct.pack(">I", 70_000))
        reader = FrameReader(r, max_frame=65_536)
        assert bytes(reader.read_frame()) == b"hello"
        # Reading it will not block (it fails at once): the watcher must not wait.
        assert reader.has_frame()
        with pytest.raises(FrameTooLarge, match="declares 70000 bytes, over the limit of 65536"):
            reader.read_frame()
    finally:
        os.close(r)
        os.close(w)


# -- frames up to the limit ----------------------------------------------------------------


def test_frames_up_to_the_limit_work_and_one_byte_more_is_refused() -> None:
    limit = MiB
    wp = spawn_worker(["--allow", D, "--max-frame-bytes", str(limit)], stderr=subprocess.PIPE)
    try:
        for size in (limit - 1, limit):
            rid = next_id()
            body = _body_of_size(size, rid)
            wp.send_raw(body)
            kind, got, value = wp.reply(rid)
            assert (kind, got) == ("ok", rid) and len(value) == len(unpackb(body)[5][0])
        assert wp.ping()["running"] is None
        wp.send_raw(_body_of_size(limit + 1, next_id()))
        status, _peak = _reap(wp.proc)
        assert status == 0
        assert f"declares {limit + 1} bytes, over the limit of {limit} bytes" in _stderr_text(
            wp.proc
        )
    finally:
        wp.stop()


def test_a_large_frame_sent_slowly_takes_memory_as_its_bytes_arrive() -> None:
    size = 192 * MiB
    wp = spawn_worker(["--allow", D])
    try:
        pid = wp.proc.pid
        assert wp.call(D, "add", 1, 2) == 3
        rss0 = _status_kib(pid, "VmRSS") * 1024
        rid = next_id()
        body = _body_of_size(size, rid)
        frame = memoryview(struct.pack(">I", size) + body)
        # The header and 16 MiB: a write returns once the worker has read all but what
        # the pipe holds (1 MiB), and its reader does nothing else meanwhile.
        _write_all(wp.to_worker, frame[: 4 + 16 * MiB])
        time.sleep(0.2)
        grown = _status_kib(pid, "VmRSS") * 1024 - rss0
        assert 8 * MiB < grown < 64 * MiB, grown  # not the 192 MiB the header declares
        _write_all(wp.to_worker, frame[4 + 16 * MiB : 4 + 112 * MiB])
        time.sleep(0.2)
        grown = _status_kib(pid, "VmRSS") * 1024 - rss0
        assert 96 * MiB < grown < 160 * MiB, grown
        _write_all(wp.to_worker, frame[4 + 112 * MiB :])
        kind, got, value = wp.reply(rid, timeout=120)
        assert (kind, got) == ("ok", rid) and len(value) == len(unpackb(body)[5][0])
        assert value[:4] == b"\x07" * 4
    finally:
        wp.stop()


# -- replies over the limit ----------------------------------------------------------------


def test_a_reply_over_the_limit_is_refused_and_its_references_dropped() -> None:
    limit = 65_536
    wp = spawn_worker(["--allow", D, "--max-frame-bytes", str(limit)])
    try:
        big = wp.call(D, "opaque", ["x" * 40_000])
        small = wp.call(D, "opaque", 0)
        refs = wp.ping()["refs"]
        # value + by: a list of 40 000 + 30 000 characters and two objects that come
        # back as new references: over 64 KiB.
        with pytest.raises(WorkerCallError) as caught:
            wp.invoke(["r", big, "bump"], [[small, small, "y" * 30_000]])
        err = caught.value.error
        assert err["type"] == "python_exception" and err["python_type"] == "ValueError"
        assert "exceeds the frame limit of 65536 bytes (max_frame_bytes)" in err["message"]
        assert int(err["message"].split()[3]) > limit  # "a reply of N bytes ..."
        # The references made for the refused reply are gone again; the worker serves.
        assert wp.ping()["refs"] == refs
        assert wp.invoke(["r", small, "bump"], [1]) == 1
    finally:
        wp.stop()


def _dispatcher(limit: int, fd: int) -> Dispatcher:
    modules = (D,)
    registry = TypeRegistry(modules)
    channel = Channel(Encoder(registry), fd=fd, max_frame=limit)
    return Dispatcher(
        Sessions("0" * 16, 100), TargetResolver(modules), registry, channel, lambda _r: None
    )


def test_an_error_reply_over_the_limit_is_cut_to_fit() -> None:
    """A Python exception whose message alone is over the limit still gets its answer."""
    limit = 65_536
    r, w = os.pipe()
    try:
        dispatcher = _dispatcher(limit, w)
        message = "m" * 200_000
        req = parse_request(["call", 7, None, None, ["m", D, "fail"], [message], {}])
        frame = dispatcher.handle(req)
        assert frame is not None and segments_length(frame) <= limit
        kind, rid, err = unpackb(b"".join(bytes(s) for s in frame))
        assert (kind, rid, err["type"], err["python_type"]) == (
            "error",
            7,
            "python_exception",
            "ValueError",
        )
        assert err["message"].startswith("m" * 2000)
        assert "over the frame limit of 65536 bytes (max_frame_bytes)" in err["message"]
        # And the channel would refuse to write anything larger, unwritten.
        with pytest.raises(FrameTooLarge, match="a frame to write has 70000 bytes"):
            dispatcher.channel.write([b"z" * 70_000])
    finally:
        os.close(r)
        os.close(w)


# -- the command line ----------------------------------------------------------------------


def test_max_frame_bytes_is_checked_on_the_command_line() -> None:
    assert parse_args([]).max_frame_bytes == DEFAULT_MAX_FRAME_BYTES
    assert parse_args(["--max-frame-bytes", "65536"]).max_frame_bytes == 65536
    for bad in ("65535", str(1 << 32), "-1"):
        with pytest.raises(SystemExit):
            parse_args(["--max-frame-bytes", bad])
