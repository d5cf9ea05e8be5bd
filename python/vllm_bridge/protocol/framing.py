"""Erlang ``{packet, 4}`` framing: a 4-byte big-endian length, then the body.

The worker reads frames from fd 3 and writes them to fd 4 (the port is opened with
``:nouse_stdio``), so stdout and stderr stay free for logs.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Sequence

READ_FD = 3
WRITE_FD = 4

_HEADER = struct.Struct(">I")
#: Largest body we accept; {packet, 4} allows up to 4 GiB - 1.
MAX_FRAME = 0xFFFF_FFFF
_IOV_MAX = 1024


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


def read_frame(fd: int = READ_FD) -> bytearray | None:
    """Read one frame body from ``fd``; ``None`` when the peer closed the stream.

    The body is returned as the buffer it was read into (no further copy).
    """
    header = _read_exact(fd, 4)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    body = _read_exact(fd, length)
    if body is None:
        raise FrameError(f"EOF before a body of {length} bytes")
    return body


class FrameReader:
    """Reads frames from ``fd`` like :func:`read_frame`, reading large ones into one
    buffer that is reused from frame to frame.

    A fresh buffer for a 64 MiB frame costs far more than reading into it (the OS maps and
    zeroes every page first), so frames of at least :attr:`reuse_min` bytes (and at most
    :attr:`reuse_max`) land in a kept buffer and come back as a ``memoryview`` of it,
    valid **only until the next** :meth:`read`: whoever decodes a frame must copy out what
    it keeps (the decoder does: msgpack builds new objects and large tensors are copied
    out, see :mod:`~vllm_bridge.protocol.splice`). Smaller frames come back as their own
    ``bytearray``.
    """

    def __init__(
        self, fd: int = READ_FD, reuse_min: int = 1 << 20, reuse_max: int = 256 << 20
    ) -> None:
        self.fd = fd
        self.reuse_min = reuse_min
        self.reuse_max = reuse_max
        self._buffer = bytearray()

    def read(self) -> bytearray | memoryview | None:
        """The next frame's body, or ``None`` when the peer closed the stream.

        Raises:
            FrameError: the stream ended inside a frame.
        """
        header = _read_exact(self.fd, 4)
        if header is None:
            return None
        (length,) = _HEADER.unpack(header)
        if not self.reuse_min <= length <= self.reuse_max:
            body = _read_exact(self.fd, length)
            if body is None:
                raise FrameError(f"EOF before a body of {length} bytes")
            return body
        if len(self._buffer) < length:
            self._buffer = bytearray(length)  # a new one: views of the old may still exist
        view = memoryview(self._buffer)[:length]
        got = 0
        while got < length:
            chunk = os.readv(self.fd, [view[got:]])
            if chunk == 0:
                raise FrameError(f"EOF after {got} of {length} bytes")
            got += chunk
        return view


def write_frame(body: bytes, fd: int = WRITE_FD) -> None:
    """Write one frame (header and body) to ``fd``, retrying short writes."""
    write_segments([body], fd)


def write_segments(segments: Sequence[bytes | memoryview], fd: int = WRITE_FD) -> None:
    """Write one frame whose body is the concatenation of ``segments``.

    The segments go to ``writev`` as they are, so a tensor's memory is written straight
    from where it lies.

    Raises:
        FrameError: the body is longer than a ``{packet, 4}`` frame can be.
    """
    views = [s if isinstance(s, memoryview) else memoryview(s) for s in segments]
    views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
    length = sum(v.nbytes for v in views)
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes exceeds {MAX_FRAME}")
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
