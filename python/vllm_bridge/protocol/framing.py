"""Erlang ``{packet, 4}`` framing: a 4-byte big-endian length, then the body.

The worker reads frames from fd 3 and writes them to fd 4 (the port is opened with
``:nouse_stdio``), so stdout and stderr stay free for logs.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

READ_FD = 3
WRITE_FD = 4

_HEADER = struct.Struct(">I")
#: Largest body we accept; {packet, 4} allows up to 4 GiB - 1.
MAX_FRAME = 0xFFFF_FFFF
_IOV_MAX = 1024


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
