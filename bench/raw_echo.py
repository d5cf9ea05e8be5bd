"""The floor of the bridge's benchmarks: a process that only reads {packet, 4} frames on
fd 3 and writes each one back unchanged on fd 4, until EOF.

No codec, no dispatch, no threads: the least a Port round trip to a Python process costs.
Like a worker, it asks for 1 MiB pipe buffers (``F_SETPIPE_SZ``, Linux), so that both sides
of a comparison use the same transport.
Started by ``mix vllm.bench`` (``bench/README.md``) as ``python bench/raw_echo.py`` on an
Erlang port opened with ``{:packet, 4}`` and ``:nouse_stdio``, like a worker.
"""

import fcntl
import os
import struct
import sys

READ_FD = 3
WRITE_FD = 4
_HEADER = struct.Struct(">I")


def _read_exact(fd: int, n: int) -> bytearray | None:
    """Exactly ``n`` bytes from ``fd``, or ``None`` at EOF."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            return None
        got += k
    return buf


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
    """As ``vllm_bridge.protocol.framing.enlarge_pipes`` (kept here to import nothing)."""
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
    while True:
        header = _read_exact(READ_FD, 4)
        if header is None:
            return 0
        (length,) = _HEADER.unpack(header)
        body = _read_exact(READ_FD, length) if length else bytearray()
        if body is None:
            return 0
        _write_all(WRITE_FD, [memoryview(header), memoryview(body)])


if __name__ == "__main__":
    sys.exit(main())
