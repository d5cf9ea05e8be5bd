"""The floor of the bridge's benchmarks: a process that only reads {packet, 4} frames on
fd 3 and writes each one back unchanged on fd 4, until EOF.

No codec, no dispatch, no threads, one buffer reused for every frame: the least a Port
round trip to a Python process costs.
Like a worker, it asks for 1 MiB pipe buffers (``F_SETPIPE_SZ``, Linux), so that both sides
of a comparison use the same transport.
Started by ``mix vllm.bench`` (``bench/README.md``) as ``python bench/raw_echo.py`` on an
Erlang port opened with ``{:packet, 4}`` and ``:nouse_stdio`` (a worker's port is opened in
``:stream`` mode and framed by the worker process, which bounds frames:
bench/results/frame-size.md, "Frame size"; the floor keeps the driver's own framing).
"""

import fcntl
import os
import struct
import sys

READ_FD = 3
WRITE_FD = 4
_HEADER = struct.Struct(">I")


def _read_into(fd: int, view: memoryview) -> bool:
    """Fill ``view`` from ``fd``; False at EOF."""
    got = 0
    while got < view.nbytes:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            return False
        got += k
    return True


def _write_all(fd: int, parts: list[memoryview]) -> None:
    """Write ``parts`` back to back with ``writev``, retrying short writes."""
    parts = [p for p in parts if p.nbytes]
    while parts:
        written = os.writev(fd, parts)
        while written:
            if written >= parts[0].nbytes:
                written -= parts.pop(0).nbytes
            else:
                parts[0] = parts[0][written:]
                written = 0


def _enlarge_pipes(size: int = 1 << 20) -> None:
    """As ``vllm_bridge.bridge.protocol.framing.enlarge_pipes`` (kept here to import nothing)."""
    try:
        with open("/proc/sys/fs/pipe-max-size") as f:
            size = min(size, int(f.read()))
    except (OSError, ValueError):
        pass
    for fd in (READ_FD, WRITE_FD):
        try:
            fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
        except OSError:
            pass


def main() -> int:
    _enlarge_pipes()
    header = memoryview(bytearray(4))
    buffer = bytearray(1 << 16)  # kept from frame to frame, grown when a frame needs it
    while True:
        if not _read_into(READ_FD, header):
            return 0
        (length,) = _HEADER.unpack(header)
        if len(buffer) < length:
            buffer = bytearray(length)
        body = memoryview(buffer)[:length]
        if not _read_into(READ_FD, body):
            return 0
        _write_all(WRITE_FD, [header, body])


if __name__ == "__main__":
    sys.exit(main())
