"""The floor under the worker's Python path per request: the least any worker that reads
msgpack frames in Python must do, with none of our bookkeeping.

Over the same file of request frames as ``worker_path.py`` (read 64 KiB at a time), each
request is: cut the frame from the buffer, ``msgpack.unpackb`` it, look its target up in
a dict keyed by (module, name), call it with its args and kwargs, ``msgpack.packb`` the
``["ok", id, result]`` reply and write header and body in one ``os.write`` to
``/dev/null``. No deadline, session, guard, cancel or reading-role hand-over: what the
worker does beyond this is the price of its guarantees
(bench/results/python-worker-second-pass.md). ``worker_path.py`` runs it beside the
worker, alternating rounds; alone::

    .venv/bin/python bench/worker_floor.py [--calls N] [--rounds R]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import worker_alone  # noqa: E402  (this directory's: the request frames)

_HEADER = struct.Struct(">I")


def targets() -> dict[tuple[str, str], Any]:
    """The floor's dispatch table: the one target the frames call."""
    _, module, name = worker_alone.TARGET
    return {(module, name): getattr(importlib.import_module(module), name)}


def floor_round(path: str, calls: int) -> float:
    """CPU microseconds per request of the floor loop over the frames in ``path``."""
    table = targets()
    unpackb, packb = msgpack.unpackb, msgpack.packb
    unpack_from, pack = _HEADER.unpack_from, _HEADER.pack
    read, write = os.read, os.write
    fd = os.open(path, os.O_RDONLY)
    out = os.open(os.devnull, os.O_WRONLY)
    try:
        start = time.thread_time()
        buf = b""
        pos = 0
        while True:
            if len(buf) - pos < 4 or len(buf) - pos - 4 < unpack_from(buf, pos)[0]:
                data = read(fd, 65536)
                if not data:
                    break
                buf = buf[pos:] + data
                pos = 0
                continue
            (n,) = unpack_from(buf, pos)
            msg = unpackb(buf[pos + 4 : pos + 4 + n])
            pos += 4 + n
            target = msg[4]
            result = table[target[1], target[2]](*msg[5], **msg[6])
            body = packb(["ok", msg[1], result])
            write(out, pack(len(body)) + body)
        return (time.thread_time() - start) / calls * 1e6
    finally:
        os.close(fd)
        os.close(out)


def write_frames(calls: int) -> str:
    """A temporary file of ``calls`` request frames (the caller deletes it)."""
    frames = worker_alone.request_frames(worker_alone.FRAMES)
    fd, path = tempfile.mkstemp(prefix="worker_floor-")
    with os.fdopen(fd, "wb") as f:
        f.write(b"".join(frames[i % len(frames)] for i in range(calls)))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100_000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds")
    opts = parser.parse_args(argv)
    for name in ("calls", "rounds"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(opts, name)}")
    path = write_frames(opts.calls)
    try:
        us = [floor_round(path, opts.calls) for _ in range(opts.rounds)]
    finally:
        os.unlink(path)
    print(
        f"floor: CPU us per request, best {min(us):.2f}, median {statistics.median(us):.2f} "
        f"({opts.rounds} rounds of {opts.calls})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
