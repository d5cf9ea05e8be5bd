"""Erlang ``{packet, 4}`` framing: a 4-byte big-endian length, then the body.

The worker reads frames from fd 3 and writes them to fd 4 (the port is opened with
``:nouse_stdio``), so stdout and stderr stay free for logs.
"""

from __future__ import annotations

import os
import struct

READ_FD = 3
WRITE_FD = 4

_HEADER = struct.Struct(">I")
#: Largest body we accept; {packet, 4} allows up to 4 GiB - 1.
MAX_FRAME = 0xFFFF_FFFF


class FrameError(Exception):
    """The byte stream ended in the middle of a frame, or a frame is too large."""


def _read_exact(fd: int, n: int) -> bytes | None:
    """Read exactly ``n`` bytes; ``None`` on EOF before the first byte."""
    if n == 0:
        return b""
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
    return bytes(buf)


def read_frame(fd: int = READ_FD) -> bytes | None:
    """Read one frame body from ``fd``; ``None`` when the peer closed the stream."""
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
    if len(body) > MAX_FRAME:
        raise FrameError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    data = memoryview(_HEADER.pack(len(body)) + body) if len(body) < 65536 else None
    if data is not None:
        _write_all(fd, data)
    else:
        _write_all(fd, memoryview(_HEADER.pack(len(body))))
        _write_all(fd, memoryview(body))


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]
