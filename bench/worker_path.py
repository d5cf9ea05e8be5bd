"""The worker's whole Python path per request, in one process and without pipes: the
execution loop (the reading role's lock, the frame reader, the running request's
bookkeeping), decoding and checking, the dispatch, the call, the reply's encoding and
its write. fd 3 is a file of ``--calls`` trivial-call request frames (read as the pipe
would be, 64 KiB at a time), replies go to ``/dev/null``; the figure is the thread's CPU
time per request (``time.thread_time``), so a busy machine's preemptions do not count.

Issue 19 (bench/results/erlport-round-trip-continued.md, "The Python worker's path", and
bench/results/python-worker-second-pass.md): run it from two trees in turn to compare
them, each tree's ``python/`` first on the path. Each round of the worker alternates with
a round of the floor (``worker_floor.py``: unpack, look up, call, pack, write, and nothing
else) over the same frames, so the gap between them, the price of the worker's
bookkeeping, is measured in the same run::

    .venv/bin/python bench/worker_path.py [--calls N] [--rounds R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))
sys.path.insert(0, str(HERE))

import worker_alone  # noqa: E402  (this directory's: the request frames)
import worker_floor  # noqa: E402  (this directory's: the floor loop)
from vllm_bridge import PUBLIC_MODULES  # noqa: E402
from vllm_bridge.bridge.worker.server import Worker, _import_allowed  # noqa: E402


def one_round(path: str, calls: int) -> float:
    """CPU microseconds per request of one pass of the execution loop over ``path``."""
    modules = tuple(PUBLIC_MODULES)
    worker = Worker(modules, 10_000, import_errors=_import_allowed(modules))
    worker.channel.fd = os.open(os.devnull, os.O_WRONLY)
    worker.executor._reader.fd = os.open(path, os.O_RDONLY)
    try:
        start = time.thread_time()
        worker.executor.run()  # until EOF: every frame read, run and answered
        return (time.thread_time() - start) / calls * 1e6
    finally:
        os.close(worker.executor._reader.fd)
        os.close(worker.channel.fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100_000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (the best and median count)")
    opts = parser.parse_args(argv)
    for name in ("calls", "rounds"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(opts, name)}")
    frames = worker_alone.request_frames(worker_alone.FRAMES)
    fd, path = tempfile.mkstemp(prefix="worker_path-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(frames[i % len(frames)] for i in range(opts.calls)))
        us, floor = [], []
        for _ in range(opts.rounds):
            us.append(one_round(path, opts.calls))
            floor.append(worker_floor.floor_round(path, opts.calls))
    finally:
        os.unlink(path)
    print(
        f"{HERE.parent}: CPU us per request, best {min(us):.2f}, median "
        f"{statistics.median(us):.2f}; the floor in the same run: best {min(floor):.2f}, "
        f"median {statistics.median(floor):.2f} ({opts.rounds} alternating rounds of "
        f"{opts.calls})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
