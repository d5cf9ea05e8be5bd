"""{packet, 4} framing: the buffered FrameReader and write_segments, over real pipes."""

from __future__ import annotations

import os
import struct
import threading

import pytest

from vllm_bridge.bridge.protocol.framing import FrameError, FrameReader, write_segments


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def test_many_small_frames_arrive_in_one_read_and_come_back_whole_and_in_order(pipe):
    r, w = pipe
    bodies = [bytes([i]) * i for i in range(50)]  # includes an empty body
    os.write(w, b"".join(frame(b) for b in bodies))
    os.close(w)
    reader = FrameReader(r)
    got = []
    while (body := reader.read_frame()) is not None:
        got.append(bytes(body))
    assert got == bodies


def test_has_frame_says_whether_a_whole_frame_is_buffered(pipe):
    r, w = pipe
    reader = FrameReader(r)
    assert not reader.has_frame()
    os.write(w, frame(b"one") + frame(b"two") + frame(b"three")[:5])
    assert bytes(reader.read_frame()) == b"one"  # one read buffers everything written
    assert reader.has_frame()
    assert bytes(reader.read_frame()) == b"two"
    assert not reader.has_frame()  # only part of "three" is here
    os.write(w, frame(b"three")[5:])
    assert bytes(reader.read_frame()) == b"three"


def test_a_frame_split_across_many_writes_is_reassembled(pipe):
    r, w = pipe
    data = frame(b"x" * 5000) + frame(b"tail")

    def trickle() -> None:
        for i in range(0, len(data), 7):
            os.write(w, data[i : i + 7])

    t = threading.Thread(target=trickle)
    t.start()
    reader = FrameReader(r)
    assert bytes(reader.read_frame()) == b"x" * 5000
    assert bytes(reader.read_frame()) == b"tail"
    t.join()


@pytest.mark.parametrize(
    ("size", "kind"),
    [((1 << 20) - 1, bytearray), (1 << 20, memoryview), ((3 << 20) + 5, memoryview)],
)
def test_large_frames_around_the_direct_read_thresholds(pipe, size, kind):
    """Below reuse_min: through the buffer, a bytearray of its own; from reuse_min to
    reuse_max: straight into the kept buffer (a view); past reuse_max: straight into a
    buffer of its own (a view of it)."""
    r, w = pipe
    body = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    data = frame(b"before") + frame(body) + frame(b"after")
    t = threading.Thread(target=lambda: os.write(w, data) and None)
    t.start()
    reader = FrameReader(r, chunk=4096, reuse_min=1 << 20, reuse_max=2 << 20)
    assert bytes(reader.read_frame()) == b"before"
    got = reader.read_frame()
    assert isinstance(got, kind) and len(got) == size and bytes(got) == body
    assert bytes(reader.read_frame()) == b"after"
    t.join()


def test_bodies_are_independent_buffers(pipe):
    r, w = pipe
    os.write(w, frame(b"aaaa") + frame(b"bbbb"))
    reader = FrameReader(r)
    first = reader.read_frame()
    second = reader.read_frame()
    first[0:1] = b"Z"
    assert bytes(second) == b"bbbb" and bytes(first) == b"Zaaa"


def test_eof_between_frames_is_none_and_inside_a_frame_is_an_error(pipe):
    r, w = pipe
    os.write(w, frame(b"whole") + frame(b"cut off")[:6])
    os.close(w)
    reader = FrameReader(r)
    assert bytes(reader.read_frame()) == b"whole"
    with pytest.raises(FrameError, match="EOF"):
        reader.read_frame()


def test_eof_inside_a_header_is_an_error(pipe):
    r, w = pipe
    os.write(w, b"\x00\x00")
    os.close(w)
    with pytest.raises(FrameError, match="EOF after 2 bytes"):
        FrameReader(r).read_frame()


@pytest.mark.parametrize("sizes", [[0], [3], [70_000], [10, 0, 200_000, 5]])
def test_write_segments_writes_one_frame_of_their_concatenation(pipe, sizes):
    r, w = pipe
    segments = [bytes([65 + i]) * n for i, n in enumerate(sizes)]
    segments[-1] = memoryview(segments[-1])  # views are written as they are
    expected = b"".join(bytes(s) for s in segments)
    t = threading.Thread(target=write_segments, args=(segments, w))
    t.start()
    assert bytes(FrameReader(r).read_frame()) == expected
    t.join()


@pytest.mark.parametrize("seed", range(6))
def test_short_writes_still_put_out_the_whole_frame(monkeypatch, seed):
    # A write may take fewer bytes than given (a signal lands in a blocking write: the
    # worker's interrupter signals the thread that writes replies). Every write here takes
    # 1-9 bytes; each frame, one segment (the small reply's path) or several, comes out
    # exactly once and whole, header included.
    import random

    from vllm_bridge.bridge.protocol import framing

    rng = random.Random(seed)
    out = bytearray()

    def short_write(fd, data):
        n = min(len(data), rng.randint(1, 9))
        out.extend(bytes(data[:n]))
        return n

    def short_writev(fd, buffers):
        data = b"".join(bytes(b) for b in buffers)
        return short_write(fd, data)

    monkeypatch.setattr(framing.os, "write", short_write)
    monkeypatch.setattr(framing.os, "writev", short_writev)
    expected = bytearray()
    for size in (0, 1, 5, 300, 4097, 70_000):
        body = bytes(rng.getrandbits(8) for _ in range(size))
        for segments in ([body], [body[: size // 2], memoryview(body[size // 2 :])]):
            write_segments(segments, fd=-1)
            expected += frame(body)
    assert out == expected


def test_a_polling_reader_gets_a_frame_written_while_it_polls(pipe):
    r, w = pipe
    reader = FrameReader(r, poll_s=0.5)
    timer = threading.Timer(0.05, lambda: os.write(w, frame(b"late")))
    timer.start()
    assert bytes(reader.read_frame()) == b"late"
    timer.join()


def test_a_polling_reader_blocks_after_its_window_and_reads_what_comes(pipe):
    r, w = pipe
    reader = FrameReader(r, poll_s=0.001)
    timer = threading.Timer(0.2, lambda: os.write(w, frame(b"after the poll")))
    timer.start()
    assert bytes(reader.read_frame()) == b"after the poll"
    os.close(w)
    assert reader.read_frame() is None
    timer.join()
