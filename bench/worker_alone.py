"""The Python side alone: the worker (``python -m vllm_bridge.bridge.worker``) beside the raw echo
(``bench/raw_echo.py``), each driven over its fd 3 / fd 4 pipes by this process with the
trivial call's request frame and a fixed number of requests in flight; no BEAM involved.

For each it reports calls per second and the CPU the driven process spent per call (user +
system time from ``/proc``, so Linux only; elsewhere that column is left out), and then
the worker's figures as ratios of the echo's: how much of a call's cost through the whole
bridge is the Python worker's own. The two alternate for ``--rounds`` rounds; the median
round of each counts. Last, the worker's own code for one call (decode, check, dispatch,
call, encode, write to ``/dev/null``) is timed in this process, without pipes or threads.
A worker reply other than ``ok`` (or a ``log`` frame) ends the run with an error, and so
does a peer silent for 30 s. Part 6 of ``make bench``; alone, from the repository root::

    .venv/bin/python bench/worker_alone.py [--calls N] [--in-flight K] [--rounds R]
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgpack

HERE = Path(__file__).resolve().parent
HEADER = struct.Struct(">I")
TARGET = ["m", "vllm_bridge.forward_context", "is_forward_context_available"]
#: Distinct request frames (ids) cycled through.
FRAMES = 1024
#: The most requests in flight: 256 frames of requests (and of the echo's replies) stay
#: inside even a 64 KiB pipe, so the driver's blocking writes cannot meet a peer blocked
#: on its own (no id is in flight twice either).
MAX_IN_FLIGHT = 256
#: Seconds a read may wait for the peer before the run is given up.
READ_TIMEOUT_S = 30.0
#: How a worker's reply of kind "ok" and its log frames begin (msgpack arrays).
OK_PREFIX = b"\x93\xa2ok"
LOG_PREFIX = b"\x94\xa3log"


class Peer:
    """A process started with fd 3 (its input) and fd 4 (its output) on pipes of ours."""

    def __init__(self, argv: list[str], hello: bool) -> None:
        to_r, self.to_w = os.pipe()
        self.from_r, from_w = os.pipe()

        def wire() -> None:  # in the child: the pipes become fds 3 and 4
            os.dup2(to_r, 3)
            os.dup2(from_w, 4)

        env = {**os.environ, "PYTHONPATH": str(HERE.parent / "python")}
        self.proc = subprocess.Popen(argv, pass_fds=(3, 4), preexec_fn=wire, env=env)
        os.close(to_r)
        os.close(from_w)
        self._buf = bytearray()
        if hello:
            kind = msgpack.unpackb(self.read_frames(1)[0])[0]
            if kind != "hello":
                raise RuntimeError(f"{argv}: expected a hello frame first, got {kind!r}")

    def read_frames(self, at_least: int) -> list[bytes]:
        """At least ``at_least`` whole frames (every whole frame already read, in fact);
        waits at most :data:`READ_TIMEOUT_S` for each read."""
        frames: list[bytes] = []
        pos = 0
        while True:
            while len(self._buf) - pos >= 4:
                (n,) = HEADER.unpack_from(self._buf, pos)
                if len(self._buf) - pos - 4 < n:
                    break
                frames.append(bytes(self._buf[pos + 4 : pos + 4 + n]))
                pos += 4 + n
            if len(frames) >= at_least:
                del self._buf[:pos]
                return frames
            if not select.select([self.from_r], [], [], READ_TIMEOUT_S)[0]:
                raise RuntimeError(f"{self.proc.args}: no frame within {READ_TIMEOUT_S} s")
            data = os.read(self.from_r, 1 << 16)
            if not data:
                raise RuntimeError(f"{self.proc.args}: output ended after {len(frames)} frames")
            self._buf += data

    def write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view.nbytes:
            view = view[os.write(self.to_w, view) :]

    def cpu_ticks(self) -> int | None:
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return int(fields[11]) + int(fields[12])  # utime + stime

    def close(self) -> None:
        os.close(self.to_w)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.from_r)


def request_frames(count: int) -> list[bytes]:
    """``count`` request frames of the trivial call (distinct ids), header included."""
    frames = []
    for i in range(count):
        body = msgpack.packb(["call", 1_000_000 + i, None, 120_000, TARGET, [], {}])
        frames.append(HEADER.pack(len(body)) + body)
    return frames


def replies(frames: list[bytes], worker: bool) -> int:
    """How many of ``frames`` answer a call: every one of the echo's; of the worker's,
    each ``ok`` (a ``log`` frame is skipped; anything else ends the run)."""
    if not worker:
        return len(frames)
    n = 0
    for frame in frames:
        if frame.startswith(OK_PREFIX):
            n += 1
        elif not frame.startswith(LOG_PREFIX):
            raise RuntimeError(f"the worker answered {msgpack.unpackb(frame)!r}")
    return n


def drive(
    peer: Peer, frames: list[bytes], calls: int, in_flight: int, worker: bool
) -> tuple[float, float | None]:
    """``calls`` round trips with ``in_flight`` outstanding: (calls/s, CPU us per call)."""
    ticks0 = peer.cpu_ticks()
    start = time.perf_counter()
    sent = min(in_flight, calls)
    peer.write_all(b"".join(frames[i % len(frames)] for i in range(sent)))
    done = 0
    while done < calls:
        got = replies(peer.read_frames(1), worker)
        done += got
        more = min(got, calls - sent)
        if more:
            peer.write_all(b"".join(frames[(sent + i) % len(frames)] for i in range(more)))
            sent += more
    elapsed = time.perf_counter() - start
    ticks1 = peer.cpu_ticks()
    cpu = None
    if ticks0 is not None and ticks1 is not None:
        cpu = (ticks1 - ticks0) / os.sysconf("SC_CLK_TCK") * 1e6 / calls
    return calls / elapsed, cpu


def in_process(frame: bytes, calls: int) -> float:
    """Microseconds per call of the worker's own code in this process, without pipes or
    threads: decode and check the frame, run the call, encode the reply and write it to
    ``/dev/null``."""
    sys.path.insert(0, str(HERE.parent / "python"))
    from vllm_bridge import PUBLIC_MODULES
    from vllm_bridge.bridge.worker.server import Worker, _import_allowed

    modules = tuple(PUBLIC_MODULES)
    worker = Worker(modules, 10_000, import_errors=_import_allowed(modules))
    worker.channel.fd = os.open(os.devnull, os.O_WRONLY)
    body = bytearray(frame[4:])
    try:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(calls):
                worker.channel.write(worker.dispatcher.handle(worker.on_frame(body)))
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
        return best
    finally:
        os.close(worker.channel.fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100_000, help="round trips per round")
    parser.add_argument(
        "--in-flight", type=int, default=32, help=f"requests outstanding (1 to {MAX_IN_FLIGHT})"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each, alternating")
    opts = parser.parse_args(argv)
    for name in ("calls", "in_flight", "rounds"):
        value = getattr(opts, name)
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if opts.in_flight > MAX_IN_FLIGHT:
        parser.error(f"--in-flight must be at most {MAX_IN_FLIGHT}, got {opts.in_flight}")

    frames = request_frames(FRAMES)
    results: dict[str, list[tuple[float, float | None]]] = {"worker": [], "echo": []}
    peers: dict[str, Peer] = {}
    try:
        peers["worker"] = Peer([sys.executable, "-m", "vllm_bridge.bridge.worker"], hello=True)
        peers["echo"] = Peer([sys.executable, str(HERE / "raw_echo.py")], hello=False)
        warm = max(1, opts.calls // 10)
        for key in ("worker", "echo"):
            drive(peers[key], frames, warm, opts.in_flight, key == "worker")
        for _ in range(opts.rounds):
            for key in ("worker", "echo"):
                results[key].append(
                    drive(peers[key], frames, opts.calls, opts.in_flight, key == "worker")
                )
    finally:
        for peer in peers.values():
            peer.close()

    rate = {k: statistics.median(r for r, _ in v) for k, v in results.items()}
    cpus = {k: [c for _, c in v if c is not None] for k, v in results.items()}
    cpu = {k: statistics.median(v) if v else None for k, v in cpus.items()}
    print(
        f"{opts.calls} calls per round, {opts.in_flight} in flight, {opts.rounds} rounds "
        f"(median round of each); frame {len(frames[0]) - 4} bytes"
    )
    print(f"{'':36s}{'calls/s':>10s}  {'CPU us/call':>11s}")
    for key, label in (("worker", "worker (python -m vllm_bridge.bridge.worker)"),
                       ("echo", "raw echo (bench/raw_echo.py)")):
        shown = "n/a" if cpu[key] is None else f"{cpu[key]:.2f}"
        print(f"{label:36s}{rate[key]:10.0f}  {shown:>11s}")
    line = f"worker / echo: {100 * rate['worker'] / rate['echo']:.1f}% of the calls/s"
    if cpu["worker"] is not None and cpu["echo"]:
        line += f", {cpu['worker'] / cpu['echo']:.2f}x the CPU per call"
    print(line)
    own = in_process(frames[0], opts.calls)
    print(f"the worker's code in one process, no pipes or threads (best of 3): {own:.2f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
