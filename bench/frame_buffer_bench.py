"""How the worker should hold a large frame's body while it arrives: what each way costs
for a 64 MiB frame read from a pipe, the way ``FrameReader`` reads fd 3.

A writer process sends frames of ``--mib`` MiB (header, then body) over a pipe of 1 MiB
(``F_SETPIPE_SZ``, as the worker asks for) as fast as it can; the reader takes them with
each strategy in turn, alternating strategy by strategy for ``--rounds`` rounds, and
reports the median per frame of the wall time and of the reader's own CPU time
(user + system). The strategies:

* ``bytearray upfront`` - ``bytearray(length)`` as soon as the header is read, then
  ``readv`` into it (the worker before bounded frames: memory for the declared length
  before a byte of body);
* ``bytearray grown`` - ``os.read`` of at most 1 MiB at a time appended to a
  ``bytearray`` (memory grows with what arrives);
* ``mmap fresh`` - an anonymous private ``mmap`` of the declared length, ``readv`` into
  it: the kernel makes a page only when it is first written, so memory grows with what
  arrives;
* ``mmap reused`` - one such mapping kept from frame to frame (its pages already exist);
* ``bytearray reused`` - one ``bytearray`` kept from frame to frame (the old reuse path).

Alone, from the repository root: ``.venv/bin/python bench/frame_buffer_bench.py
[--mib N] [--rounds R]``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import struct
import subprocess
import sys
import time

_HEADER = struct.Struct(">I")
_STEP = 1 << 20

_WRITER = r"""
import os, struct, sys, fcntl
fd = int(sys.argv[1]); n = int(sys.argv[2]); frames = int(sys.argv[3])
try:
    fcntl.fcntl(fd, 1031, 1 << 20)
except OSError:
    pass
body = memoryview(bytearray(os.urandom(1 << 20)) * (n >> 20))
head = struct.pack(">I", n)
for _ in range(frames):
    parts = [memoryview(head), body]
    while parts:
        k = os.writev(fd, parts)
        while k:
            if k >= parts[0].nbytes:
                k -= parts.pop(0).nbytes
            else:
                parts[0] = parts[0][k:]
                k = 0
"""


def _read_exact_into(fd: int, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            raise EOFError
        got += k


def _header(fd: int) -> int:
    head = bytearray(4)
    _read_exact_into(fd, memoryview(head))
    return _HEADER.unpack(head)[0]


def _fresh_map(n: int) -> mmap.mmap:
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class Strategies:
    """One method per strategy: read one frame from ``fd``, return its body's length."""

    def __init__(self) -> None:
        self.kept_map: mmap.mmap | None = None
        self.kept_array: bytearray | None = None

    def bytearray_upfront(self, fd: int) -> int:
        n = _header(fd)
        buf = bytearray(n)
        _read_exact_into(fd, memoryview(buf))
        return len(buf)

    def bytearray_grown(self, fd: int) -> int:
        n = _header(fd)
        buf = bytearray()
        while len(buf) < n:
            data = os.read(fd, min(_STEP, n - len(buf)))
            if not data:
                raise EOFError
            buf += data
        return len(buf)

    def mmap_fresh(self, fd: int) -> int:
        n = _header(fd)
        m = _fresh_map(n)
        view = memoryview(m)
        _read_exact_into(fd, view)
        view.release()
        m.close()
        return n

    def mmap_reused(self, fd: int) -> int:
        n = _header(fd)
        if self.kept_map is None or len(self.kept_map) < n:
            self.kept_map = _fresh_map(n)
        with memoryview(self.kept_map)[:n] as view:
            _read_exact_into(fd, view)
        return n

    def bytearray_reused(self, fd: int) -> int:
        n = _header(fd)
        if self.kept_array is None or len(self.kept_array) < n:
            self.kept_array = bytearray(n)
        with memoryview(self.kept_array)[:n] as view:
            _read_exact_into(fd, view)
        return n


NAMES = ["bytearray upfront", "bytearray grown", "mmap fresh", "mmap reused", "bytearray reused"]


def _cpu() -> float:
    return time.process_time()


def main() -> int:
    parser = argparse.ArgumentParser(prog="frame_buffer_bench.py")
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    opts = parser.parse_args()
    n = opts.mib << 20
    s = Strategies()
    methods = {name: getattr(s, name.replace(" ", "_")) for name in NAMES}
    # One warm-up frame per strategy, then `rounds` per strategy, interleaved.
    frames = len(NAMES) * (opts.rounds + 1)
    r, w = os.pipe()
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(w), str(n), str(frames)], pass_fds=(w,)
    )
    os.close(w)
    try:
        import fcntl

        fcntl.fcntl(r, 1031, 1 << 20)
    except OSError:
        pass
    wall: dict[str, list[float]] = {name: [] for name in NAMES}
    cpu: dict[str, list[float]] = {name: [] for name in NAMES}
    for rnd in range(opts.rounds + 1):
        for name in NAMES:
            t0, c0 = time.perf_counter(), _cpu()
            assert methods[name](r) == n
            t1, c1 = time.perf_counter(), _cpu()
            if rnd:
                wall[name].append((t1 - t0) * 1000)
                cpu[name].append((c1 - c0) * 1000)
    writer.wait()
    os.close(r)
    print(f"{opts.mib} MiB frames over a 1 MiB pipe, {opts.rounds} rounds (median per frame)")
    print(f"{'strategy':<20} {'wall ms':>9} {'reader CPU ms':>14}")
    for name in NAMES:
        print(
            f"{name:<20} {statistics.median(wall[name]):>9.1f} "
            f"{statistics.median(cpu[name]):>14.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
