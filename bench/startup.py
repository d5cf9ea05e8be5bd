"""Where a worker's start goes, from inside Python: how long ``python -m vllm_bridge.bridge.worker``
takes until its ``hello`` arrives, and the steps that make it up.

Each figure is the median of ``--runs`` fresh processes (a process imports each module
once, so every step needs a process of its own):

* interpreter: ``python -c pass``, from spawn to exit;
* to hello: the worker itself, spawned on fd 3 / fd 4 pipes, from spawn until its
  ``hello`` frame has been read (then its fd 3 is closed and it exits);
* in one process, the worker's own start-up steps, run with its own functions and timed
  in place (``_STEPS`` below): importing the worker (the protocol imports torch), the
  allow-listed modules (``_import_allowed``), the hello (``_hello``), and, for
  comparison, what the hello's device name costs when it asks CUDA for the current
  device (initialises CUDA on a GPU machine);
* ``import torch`` alone, in a process of its own.

From the repository root (the part of ``make bench`` it is not: it starts dozens of
processes)::

    .venv/bin/python bench/startup.py [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import struct
import subprocess
import sys
import time

_STEPS = r"""
import json, time
t0 = time.perf_counter()
from vllm_bridge import PUBLIC_MODULES
from vllm_bridge.bridge.worker import server
t1 = time.perf_counter()
errors = server._import_allowed(tuple(PUBLIC_MODULES))
t2 = time.perf_counter()
server._hello("0" * 16, tuple(PUBLIC_MODULES), errors)
t3 = time.perf_counter()
import torch
cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.current_device()
t4 = time.perf_counter()
print(json.dumps({"worker imports (torch among them)": t1 - t0,
                  "allow-listed modules": t2 - t1, "hello": t3 - t2,
                  "current_device() (CUDA init)": t4 - t3, "cuda": cuda}))
"""

_TORCH = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"


def _wall(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def _to_hello(python: str) -> float:
    """Seconds from spawning a worker until its hello frame has been read whole."""
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()

    def wire() -> None:
        a, b = os.dup(r_in), os.dup(w_out)
        while a < 5:
            a = os.dup(a)
        while b < 5:
            b = os.dup(b)
        os.dup2(a, 3)
        os.dup2(b, 4)

    t = time.perf_counter()
    proc = subprocess.Popen(
        [python, "-m", "vllm_bridge.bridge.worker"], preexec_fn=wire, pass_fds=(3, 4), close_fds=True
    )
    os.close(r_in)
    os.close(w_out)
    try:
        header = _read(r_out, 4)
        _read(r_out, struct.unpack(">I", header)[0])
        elapsed = time.perf_counter() - t
    finally:
        os.close(w_in)  # EOF: the worker exits
        proc.wait(timeout=30)
        os.close(r_out)
    return elapsed


def _read(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        ready, _, _ = select.select([fd], [], [], 60)
        if not ready:
            raise TimeoutError("no hello from the worker within 60 s")
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("the worker exited before its hello")
        data += chunk
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="processes per figure (default 7)")
    opts = parser.parse_args()
    python = sys.executable
    interpreter, hello, torch_alone, steps = [], [], [], []
    for _ in range(opts.runs):  # interleaved, so a busy moment spreads over all figures
        interpreter.append(_wall([python, "-c", "pass"]))
        hello.append(_to_hello(python))
        torch_alone.append(float(subprocess.check_output([python, "-c", _TORCH])))
        steps.append(json.loads(subprocess.check_output([python, "-c", _STEPS])))

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1000:7.0f} ms   (min {min(values) * 1000:.0f})"

    print(f"median of {opts.runs} processes each; Python {sys.version.split()[0]}")
    print(f"  interpreter start (python -c pass)        {ms(interpreter)}")
    print(f"  worker, spawn to hello                     {ms(hello)}")
    print(f"  import torch, alone                        {ms(torch_alone)}")
    print(f"  worker steps in one process (CUDA: {steps[0]['cuda']}):")
    for name in steps[0]:
        if name != "cuda":
            print(f"    {name:<40} {ms([s[name] for s in steps])}")


if __name__ == "__main__":
    main()
