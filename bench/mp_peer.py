"""The Python peer of the bridge's round-trip benchmark: ``multiprocessing.Pool.apply`` of
the same trivial call (``vllm_bridge.forward_context.is_forward_context_available``) in
one pool process, timed call by call.

Run by ``mix vllm.bench`` (or alone, from the repository root)::

    .venv/bin/python bench/mp_peer.py [--calls N] [--warmup W]

Prints one line: ``mp_pool_apply calls=N p50_us=.. p99_us=.. mean_us=..``.
"""

import argparse
import math
import multiprocessing as mp
import statistics
import time

from vllm_bridge.forward_context import is_forward_context_available


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (``p`` in 0..100)."""
    if not sorted_values:
        raise ValueError("no values")
    rank = max(1, min(len(sorted_values), math.ceil(p / 100 * len(sorted_values))))
    return sorted_values[rank - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5_000, help="timed calls")
    parser.add_argument("--warmup", type=int, default=500, help="untimed calls first")
    args = parser.parse_args()
    if args.calls < 1 or args.warmup < 0:
        parser.error(f"--calls must be >= 1 and --warmup >= 0, got {args.calls}, {args.warmup}")

    with mp.Pool(1) as pool:
        for _ in range(args.warmup):
            pool.apply(is_forward_context_available)
        samples = []
        for _ in range(args.calls):
            start = time.perf_counter_ns()
            pool.apply(is_forward_context_available)
            samples.append((time.perf_counter_ns() - start) / 1000)
    samples.sort()
    print(
        f"mp_pool_apply calls={args.calls} p50_us={percentile(samples, 50):.1f} "
        f"p99_us={percentile(samples, 99):.1f} mean_us={statistics.fmean(samples):.1f}"
    )


if __name__ == "__main__":
    main()
