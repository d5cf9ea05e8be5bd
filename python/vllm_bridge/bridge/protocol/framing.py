"""Frames as Erlang's ``{packet, 4}`` has them: a 4-byte big-endian length, then the body,
with every body bounded by a limit (``--max-frame-bytes``) in both directions.

The worker reads frames from fd 3 and writes them to fd 4 (the port is opened with
``:nouse_stdio``), so stdout and stderr stay free for logs. The Elixir side cuts the same
frames itself (its port is in ``:stream`` mode, so that it can bound them too).
"""

from __future__ import annotations

import mmap
import os
import select
import struct
import sys
import time
from collections.abc import Sequence

READ_FD = 3
WRITE_FD = 4

_HEADER = struct.Struct(">I")
#: Largest body a 4-byte header can declare (4 GiB - 1).
MAX_FRAME = 0xFFFF_FFFF
#: The default limit of a frame's body, both ways (``--max-frame-bytes``; the pool option
#: ``max_frame_bytes`` on the Elixir side has the same default).
DEFAULT_MAX_FRAME_BYTES = 1 << 30
#: The smallest limit allowed: the handshake, pings and error replies must always fit.
MIN_MAX_FRAME_BYTES = 64 << 10
_IOV_MAX = 1024


def check_max_frame(limit: int) -> int:
    """``limit`` if it is a valid frame limit (an int from :data:`MIN_MAX_FRAME_BYTES` to
    :data:`MAX_FRAME`), else ``ValueError`` naming it."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"a frame limit must be an int, got {limit!r}")
    if not MIN_MAX_FRAME_BYTES <= limit <= MAX_FRAME:
        raise ValueError(
            f"a frame limit must be from {MIN_MAX_FRAME_BYTES} to {MAX_FRAME} bytes, got {limit}"
        )
    return limit


#: Pipe capacity a worker asks for: a large frame then crosses in 1 MiB steps instead of
#: the default 64 KiB ones (fewer wake-ups of both processes).
PIPE_SIZE = 1 << 20


def enlarge_pipes(
    fds: Sequence[int] = (READ_FD, WRITE_FD), size: int = PIPE_SIZE
) -> dict[int, int]:
    """Ask Linux for pipe buffers of ``size`` bytes on ``fds`` (``F_SETPIPE_SZ``), or the
    system's limit (``/proc/sys/fs/pipe-max-size``) when that is lower.

    Returns the capacity each fd got; an fd that is not a pipe, or a system without the
    call, keeps its buffer (and is left out). Never raises.
    """
    if not sys.platform.startswith("linux"):
        return {}
    import fcntl

    setter = getattr(fcntl, "F_SETPIPE_SZ", 1031)
    try:
        with open("/proc/sys/fs/pipe-max-size") as f:
            size = min(size, int(f.read()))
    except (OSError, ValueError):
        pass
    got = {}
    for fd in fds:
        try:
            got[fd] = fcntl.fcntl(fd, setter, size)
        except OSError:
            continue
    return got


class FrameError(Exception):
    """The byte stream ended in the middle of a frame, or a frame is too large."""


class FrameTooLarge(FrameError):
    """A frame's length is over the limit: declared by a header that was read (the input
    can no longer be trusted: a length-prefixed stream cannot find the next frame), or
    of a frame about to be written (refused before any byte of it is)."""

    def __init__(self, length: int, limit: int, what: str = "a frame header declares") -> None:
        super().__init__(
            f"{what} {length} bytes, over the limit of {limit} bytes (max_frame_bytes)"
        )
        self.length = length
        self.limit = limit


def _anonymous_map(length: int) -> mmap.mmap:
    """``length`` bytes of private anonymous memory: the kernel makes each page when it is
    first written, so a large body takes memory only as fast as its bytes arrive (and a
    fresh map costs less than a ``bytearray``, which writes zeros over every page first;
    see bench/frame_buffer_bench.py)."""
    return mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _read_exact(fd: int, n: int) -> bytearray | None:
    """Read exactly ``n`` bytes; ``None`` on EOF before the first byte."""
    if n == 0:
        return bytearray()
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        chunk = os.readv(fd, [view[got:]])
        if chunk == 0:
            if got == 0:
                return None
            raise FrameError(f"EOF after {got} of {n} bytes")
        got += chunk
    return buf


def read_frame(fd: int = READ_FD, limit: int = MAX_FRAME) -> bytearray | None:
    """Read one frame body from ``fd``; ``None`` when the peer closed the stream.

    The body is returned as the buffer it was read into (no further copy). A header that
    declares more than ``limit`` bytes raises :class:`FrameTooLarge` before the body's
    buffer is made.
    """
    header = _read_exact(fd, 4)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length > limit:
        raise FrameTooLarge(length, limit)
    body = _read_exact(fd, length)
    if body is None:
        raise FrameError(f"EOF before a body of {length} bytes")
    return body


class FrameReader:
    """Reads frames from ``fd`` through a buffer: one ``read`` brings in every small frame
    that has arrived, not one syscall per header and one per body.

    * A header that declares more than ``max_frame`` bytes raises :class:`FrameTooLarge`
      before anything is allocated for the body: the stream cannot be trusted any more.
    * A small body comes back as a fresh ``bytearray`` of its own.
    * A body of ``reuse_min`` bytes or more is read straight into anonymous memory
      (:func:`_anonymous_map`), whose pages exist only once written: the process grows
      with the bytes that actually arrive, not with what the header declares. One such
      buffer of up to ``reuse_max`` bytes is kept from frame to frame (its pages already
      exist, which makes a 64 MiB read about twice as fast here) and the body comes back
      as a ``memoryview`` of it, valid **only until the next** :meth:`read_frame`
      (:meth:`release` drops it: the worker does once it has been idle for
      ``IDLE_RELEASE_SECONDS``, so that one large frame does not keep its memory for good):
      whoever decodes a frame must copy out what it keeps (the decoder does: msgpack
      builds new objects and large tensors are copied out, see
      :mod:`~vllm_bridge.bridge.protocol.splice`).
    * A body over ``reuse_max`` bytes gets a buffer of its own, also as a ``memoryview``.

    With ``poll_s`` > 0, a read that finds nothing buffered first polls ``fd`` (without
    sleeping) for up to that many seconds before it blocks: the next request of a busy
    caller then finds the thread awake, which on a virtual machine saves the tens of
    microseconds of waking an idle CPU, at the price of that much CPU after each frame.

    Not thread-safe: one thread reads at a time (the worker hands the reading role over
    under a lock, see :mod:`vllm_bridge.bridge.worker.executor`), and each frame is decoded
    before the next is read.
    """

    def __init__(
        self,
        fd: int = READ_FD,
        chunk: int = 65536,
        reuse_min: int = 1 << 20,
        reuse_max: int = 256 << 20,
        poll_s: float = 0.0,
        max_frame: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        self.fd = fd
        self.poll_s = poll_s
        self.reuse_min = reuse_min
        self.reuse_max = reuse_max
        self.max_frame = check_max_frame(max_frame)
        self._chunk = chunk
        self._buf = bytearray()
        self._pos = 0
        self._large: mmap.mmap | None = None

    def has_frame(self) -> bool:
        """True when reading the next frame will not block: a whole frame is buffered,
        or a buffered header already declares too much (reading it fails at once)."""
        avail = len(self._buf) - self._pos
        if avail < 4:
            return False
        (length,) = _HEADER.unpack_from(self._buf, self._pos)
        return avail - 4 >= length or length > self.max_frame

    def _fill(self, need: int) -> bool:
        """Buffer at least ``need`` unread bytes; False on EOF with nothing unread."""
        while len(self._buf) - self._pos < need:
            if self._pos and self._pos == len(self._buf):
                self._buf.clear()
                self._pos = 0
            if self.poll_s > 0 and len(self._buf) == self._pos:
                self._poll()
            data = os.read(self.fd, max(self._chunk, need - (len(self._buf) - self._pos)))
            if not data:
                unread = len(self._buf) - self._pos
                if unread == 0:
                    return False
                raise FrameError(f"EOF after {unread} bytes of an expected {need}")
            self._buf += data
        return True

    def _poll(self) -> None:
        """Until ``fd`` is readable or ``poll_s`` has passed, ask without sleeping."""
        end = time.monotonic() + self.poll_s
        fds = [self.fd]
        while not select.select(fds, [], [], 0)[0] and time.monotonic() < end:
            pass

    def read_frame(self) -> bytearray | memoryview | None:
        """The next frame body; ``None`` when the peer closed the stream between frames.

        Raises:
            FrameTooLarge: the header declares more than ``max_frame`` bytes (nothing is
                allocated for it; the stream is not usable after this).
            FrameError: the stream ended inside a frame.
        """
        # _fill is called only when what is buffered falls short (a small request comes
        # whole in one read: the body's fill would be a call that does nothing). The
        # buffer is one bytearray for good (_fill and the cuts below change it in place).
        buf, pos = self._buf, self._pos
        if len(buf) - pos < 4:
            if not self._fill(4):
                return None
            pos = self._pos
        (length,) = _HEADER.unpack_from(buf, pos)
        if length > self.max_frame:
            raise FrameTooLarge(length, self.max_frame)
        pos += 4
        if length > len(buf) - pos:
            self._pos = pos
            if length >= self.reuse_min:
                return self._read_large(length)
            if not self._fill(length):
                raise FrameError(f"EOF before a body of {length} bytes")
            pos = self._pos
        end = pos + length
        body = buf[pos:end]
        if end == len(buf):
            buf.clear()
            end = 0
        elif end >= self._chunk:
            del buf[:end]
            end = 0
        self._pos = end
        return body

    def release(self) -> bool:
        """Drop the buffer kept for large frames (its memory goes back to the system once
        no body read into it is alive any more); the next large frame makes a new one.
        Safe from another thread than the reader's (the worker's watcher calls it once the
        worker has been idle a while): a read under way holds the buffer itself. Returns
        whether one was kept."""
        kept, self._large = self._large, None
        return kept is not None

    def _read_large(self, length: int) -> memoryview:
        if length > self.reuse_max:
            target = _anonymous_map(length)
        else:
            # Read once: release() may drop the attribute meanwhile (from another thread).
            target = self._large
            if target is None or len(target) < length:
                # A new one (views of the old may live on; it goes with the last of them).
                target = self._large = _anonymous_map(length)
        view = memoryview(target)[:length]
        # What is buffered already goes first, the rest is read straight into place.
        unread = len(self._buf) - self._pos
        view[:unread] = memoryview(self._buf)[self._pos :]
        self._buf.clear()
        self._pos = 0
        got = unread
        while got < length:
            n = os.readv(self.fd, [view[got:]])
            if n == 0:
                raise FrameError(f"EOF after {got} of {length} bytes")
            got += n
        return view


def write_frame(body: bytes, fd: int = WRITE_FD, limit: int = MAX_FRAME) -> None:
    """Write one frame (header and body) to ``fd``, retrying short writes."""
    write_segments([body], fd, limit)


def frame_bytes(body: bytes) -> bytes:
    """Header and ``body`` as one ``bytes`` (a small frame to write later)."""
    return _HEADER.pack(len(body)) + body


def write_all(fd: int, data: bytes) -> None:
    """Write ``data`` to ``fd`` whole, retrying short writes (a pipe nearly full)."""
    written = os.write(fd, data)
    if written < len(data):
        view = memoryview(data)[written:]
        while view.nbytes:
            view = view[os.write(fd, view) :]


def write_segments(
    segments: Sequence[bytes | memoryview], fd: int = WRITE_FD, limit: int = MAX_FRAME
) -> None:
    """Write one frame whose body is the concatenation of ``segments``.

    The segments go to ``writev`` as they are, so a tensor's memory is written straight
    from where it lies.

    Raises:
        FrameTooLarge: the body is longer than ``limit`` (nothing is written).
    """
    if len(segments) == 1 and type(segments[0]) is bytes and len(segments[0]) < 65536:
        # The common small reply (under any limit): one write of header and body together.
        data = _HEADER.pack(len(segments[0])) + segments[0]
        written = os.write(fd, data)
        if written < len(data):  # a short write (a pipe nearly full): the rest in a loop
            view = memoryview(data)[written:]
            while view.nbytes:
                view = view[os.write(fd, view) :]
        return
    views = [s if isinstance(s, memoryview) else memoryview(s) for s in segments]
    views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
    length = sum(v.nbytes for v in views)
    if length > min(limit, MAX_FRAME):
        raise FrameTooLarge(length, min(limit, MAX_FRAME), "a frame to write has")
    pending = [memoryview(_HEADER.pack(length))] + [v for v in views if v.nbytes]
    while pending:
        written = os.writev(fd, pending[:_IOV_MAX])
        while written:
            head = pending[0]
            if written >= head.nbytes:
                written -= head.nbytes
                pending.pop(0)
            else:
                pending[0] = head[written:]
                written = 0
