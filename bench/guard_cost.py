"""What the value guard (python/vllm_bridge/bridge/worker/guard.py, docs/SECURITY.md) costs per
call: the worker's own code for one call (decode, check, dispatch, call, encode, a write
to ``/dev/null``), in this process without pipes or threads, for a few kinds of request,
with the guard as the worker has it and with a guard that lets everything through (the
floor: what the same code costs without the checks), alternating in the same run.

Not a part of ``make bench``; from the repository root::

    .venv/bin/python bench/guard_cost.py [--calls N] [--rounds R]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))

from vllm_bridge.bridge.diag import Opaque  # noqa: E402
from vllm_bridge.bridge.protocol import packb  # noqa: E402
from vllm_bridge.bridge.worker.guard import Guard  # noqa: E402
from vllm_bridge.bridge.worker.guard_calls import CallRule  # noqa: E402
from vllm_bridge.bridge.worker.guard_steps import StepRule  # noqa: E402
from vllm_bridge.bridge.worker.server import Worker, _import_allowed  # noqa: E402

D = "vllm_bridge.bridge.diag"
FC = "vllm_bridge.forward_context"
MODULES = (D, FC)


class Open(Guard):
    """A guard that refuses nothing: the same dispatch code, no checks (no value rule,
    no step rule, no call rule). Its ``passed`` holds the one-step targets' objects, so
    the resolver's fast path skips ``check`` as it does with the real guard (the floor
    keeps that one dict lookup)."""

    def __init__(self, allowed: frozenset[str], one_step: list[Any]) -> None:
        super().__init__(allowed)
        self.passed = {id(obj): obj for obj in one_step}
        self.steps = _OpenSteps(allowed)
        self.calls = _OpenCalls(allowed)
        self.calls.passed = dict(self.passed)  # the dispatcher's look, as with the guard

    def check(self, value: Any, where: str) -> Any:
        return value

    def reason(self, value: Any) -> str | None:
        return None


class _OpenSteps(StepRule):
    def check(self, obj: Any, name: str, where: str) -> None:
        return None


class _OpenCalls(CallRule):
    def check(self, fn: Any, where: str, args: Any = (), kwargs: Any = None, note: str = "") -> None:
        return None


def requests(worker: Worker) -> dict[str, list[Any]]:
    """The kinds of request timed, as messages (their ids are filled in per call)."""
    opaque = worker.sessions.new_ref(worker.sessions.get(None), Opaque(0))
    return {
        "module function -> bool (the hot path)": ["m", FC, "is_forward_context_available"],
        "3-step path -> str method": ["m", D, "Level.HIGH.name.upper"],
        "method of a reference -> int": ["r", opaque, "bump"],
        "reference as argument -> a new reference": (["m", D, "echo"], [opaque]),
    }


def time_kind(worker: Worker, msg: Any, calls: int, guard: Guard) -> float:
    """Microseconds per call of ``msg`` with ``guard``."""
    worker.dispatcher.resolver.guard = guard
    target, args = msg if isinstance(msg, tuple) else (msg, [])
    bodies = [bytearray(packb(["call", i, None, None, target, args, {}])) for i in range(64)]
    session = worker.sessions.get(None)
    base = set(session.refs)
    start = time.perf_counter()
    for i in range(calls):
        worker.channel.write(worker.dispatcher.handle(worker.on_frame(bodies[i & 63])))
    elapsed = time.perf_counter() - start
    for ref_id in set(session.refs) - base:  # references the replies made
        worker.sessions.drop(session, ref_id)
    return elapsed / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50_000, help="calls per kind and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, alternating")
    opts = parser.parse_args(argv)
    if opts.calls < 1 or opts.rounds < 1:
        parser.error("--calls and --rounds must be at least 1")
    worker = Worker(MODULES, 10 * opts.calls, import_errors=_import_allowed(MODULES))
    worker.channel.fd = os.open(os.devnull, os.O_WRONLY)
    resolver = worker.dispatcher.resolver
    one_step = [resolver.module(FC).is_forward_context_available]
    guarded, open_ = resolver.guard, Open(frozenset(MODULES), one_step)
    try:
        kinds = requests(worker)
        figures: dict[str, dict[str, list[float]]] = {k: {"on": [], "off": []} for k in kinds}
        for name, msg in kinds.items():  # warm both (caches, imports)
            time_kind(worker, msg, opts.calls // 10 + 1, guarded)
            time_kind(worker, msg, opts.calls // 10 + 1, open_)
        for _ in range(opts.rounds):
            for name, msg in kinds.items():
                figures[name]["on"].append(time_kind(worker, msg, opts.calls, guarded))
                figures[name]["off"].append(time_kind(worker, msg, opts.calls, open_))
    finally:
        os.close(worker.channel.fd)
    print(f"{opts.calls} calls per kind and round, {opts.rounds} rounds (best round of each)")
    print(f"{'':44s}{'guard us':>9s}{'none us':>9s}{'added us':>10s}{'added':>8s}")
    for name, fig in figures.items():
        on, off = min(fig["on"]), min(fig["off"])
        print(f"{name:44s}{on:9.2f}{off:9.2f}{on - off:10.2f}{100 * (on - off) / off:7.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
