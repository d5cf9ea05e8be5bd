"""What the worker's two Python fast paths save: ``plain_call`` (parsing a common ``call``
without the checks that name errors, protocol/messages.py) and ``_reply``'s plain-scalar
branch (a reply packed by msgpack directly, without the encoder, worker/dispatch.py).

Each is timed against its general path (``parse_checked``, ``Dispatcher._encode_reply``)
on the same input, and the whole call in this process (decode and check the frame, run
the call, encode the reply, write it to ``/dev/null``, as ``worker_alone.py`` does) is
timed with both fast paths, without each, and without both, in alternating rounds; the
median round counts. python/tests/bridge/test_fast_paths.py checks that each
fast path answers exactly as its general path. From the repository root::

    .venv/bin/python bench/fast_paths.py [--calls N] [--rounds R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))

from vllm_bridge import PUBLIC_MODULES  # noqa: E402
from vllm_bridge.bridge.protocol import messages  # noqa: E402
from vllm_bridge.bridge.worker.dispatch import Dispatcher  # noqa: E402
from vllm_bridge.bridge.worker.server import Worker, _import_allowed  # noqa: E402

TARGET = ["m", "vllm_bridge.forward_context", "is_forward_context_available"]
CALLS = {
    "trivial call": ["call", 7, None, 5000, TARGET, [], {}],
    "call with args": ["call", 7, "s1", 5000, ["m", "vllm_bridge.bridge.diag", "add"], [1, 2],
                       {"k": 1}],
}  # fmt: skip
REPLIES = {"False": False, "None": None, "42": 42, "short str": "ok", "1 KiB str": "x" * 1024}


def per_call(fn: Callable[[], Any], calls: int, rounds: int) -> float:
    """Median over ``rounds`` of the microseconds per call of ``fn``."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def whole_call(worker: Worker, body: bytearray, calls: int) -> float:
    """Microseconds per call of the worker's own code for one request."""
    handle, on_frame, write = worker.dispatcher.handle, worker.on_frame, worker.channel.write
    start = time.perf_counter()
    for _ in range(calls):
        write(handle(on_frame(body)))
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100_000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each")
    opts = parser.parse_args(argv)
    if opts.calls < 1 or opts.rounds < 1:
        parser.error(f"--calls and --rounds must be at least 1, got {opts.calls}, {opts.rounds}")

    modules = tuple(PUBLIC_MODULES)
    worker = Worker(modules, 10_000, import_errors=_import_allowed(modules))
    worker.channel.fd = os.open(os.devnull, os.O_WRONLY)
    d = worker.dispatcher
    now = time.monotonic()
    try:
        print(f"parsing a decoded request, us per call (median of {opts.rounds} rounds)")
        for name, msg in CALLS.items():
            fast = per_call(lambda: messages.parse_request(msg, now), opts.calls, opts.rounds)
            general = per_call(lambda: messages.parse_checked(msg, now), opts.calls, opts.rounds)
            print(f"  {name:<16} fast {fast:6.3f}  general {general:6.3f}  "
                  f"saves {general - fast:6.3f}")  # fmt: skip
        req = messages.parse_request(CALLS["trivial call"], now)
        session = worker.sessions.get(None)
        print("encoding a reply, us per call")
        for name, value in REPLIES.items():
            fast = per_call(lambda: d._reply(req, session, "ok", value), opts.calls, opts.rounds)
            general = per_call(
                lambda: d._encode_reply(req, session, "ok", value), opts.calls, opts.rounds
            )
            print(f"  {name:<16} fast {fast:6.3f}  general {general:6.3f}  "
                  f"saves {general - fast:6.3f}")  # fmt: skip

        body = bytearray(msgpack.packb(CALLS["trivial call"]))
        plain_call, reply = messages.plain_call, Dispatcher._reply
        variants: dict[str, tuple[Any, Any]] = {
            "both fast paths": (plain_call, reply),
            "without plain_call": (lambda msg, now: None, reply),
            "without _reply's": (plain_call, Dispatcher._encode_reply),
            "without both": (lambda msg, now: None, Dispatcher._encode_reply),
        }
        results: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(opts.rounds):
            for name, (parse, encode) in variants.items():
                messages.plain_call, Dispatcher._reply = parse, encode
                try:
                    whole_call(worker, body, opts.calls // 10)  # warm
                    results[name].append(whole_call(worker, body, opts.calls))
                finally:
                    messages.plain_call, Dispatcher._reply = plain_call, reply
        base = statistics.median(results["both fast paths"])
        print("the whole trivial call in this process, us per call")
        for name, times in results.items():
            t = statistics.median(times)
            print(f"  {name:<20} {t:6.3f}  ({(t - base) / base * 100:+5.1f}% of {base:.3f})")
    finally:
        os.close(worker.channel.fd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
