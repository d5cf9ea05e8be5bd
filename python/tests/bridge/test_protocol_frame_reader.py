"""FrameReader (large frames read into one reused buffer) and enlarge_pipes."""

import os
import struct
import threading
from pathlib import Path

import pytest

from vllm_bridge.bridge.protocol.framing import FrameError, FrameReader, enlarge_pipes


def _feed(frames: list[bytes], close: bool = True) -> tuple[int, threading.Thread]:
    r, w = os.pipe()

    def writer() -> None:
        for body in frames:
            data = struct.pack(">I", len(body)) + body
            view = memoryview(data)
            while view:
                view = view[os.write(w, view) :]
        if close:
            os.close(w)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    return r, thread


def test_large_frames_share_one_buffer_small_ones_get_their_own() -> None:
    big1, big2, small = os.urandom(3 << 20), os.urandom(2 << 20), b"hello"
    r, thread = _feed([big1, small, big2, b""])
    reader = FrameReader(r, reuse_min=1 << 20)
    first = reader.read_frame()
    assert isinstance(first, memoryview) and bytes(first) == big1
    kept = bytes(first)
    second = reader.read_frame()
    assert isinstance(second, bytearray) and second == small
    third = reader.read_frame()
    assert bytes(third) == big2
    assert third.obj is first.obj  # the same buffer, reused ...
    assert bytes(first[: len(big2)]) == big2  # ... so the old view now shows the new frame
    assert kept == big1
    assert reader.read_frame() == bytearray()
    assert reader.read_frame() is None  # EOF between frames
    thread.join()
    os.close(r)


def test_a_larger_frame_gets_a_new_buffer_and_old_views_stay_valid() -> None:
    a, b = os.urandom(1 << 20), os.urandom(3 << 20)
    r, thread = _feed([a, b])
    reader = FrameReader(r, reuse_min=1 << 20)
    first = reader.read_frame()
    second = reader.read_frame()
    assert second.obj is not first.obj and bytes(first) == a and bytes(second) == b
    thread.join()
    os.close(r)


def test_eof_inside_a_large_frame_is_an_error() -> None:
    r, w = os.pipe()
    os.write(w, struct.pack(">I", 2 << 20) + b"x" * 1000)
    os.close(w)
    with pytest.raises(FrameError, match=r"EOF after 1000 of 2097152 bytes"):
        FrameReader(r, reuse_min=1 << 20).read_frame()
    os.close(r)


def test_enlarge_pipes_grows_pipes_and_leaves_other_fds_alone(tmp_path: Path) -> None:
    if not os.uname().sysname == "Linux":
        pytest.skip("F_SETPIPE_SZ is Linux only")
    r, w = os.pipe()
    with open(tmp_path / "f", "wb") as f:
        got = enlarge_pipes((r, w, f.fileno()), size=256 << 10)
    assert set(got) == {r, w} and all(v >= 256 << 10 for v in got.values())
    os.close(r)
    os.close(w)
