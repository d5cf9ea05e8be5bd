"""Benchmark: set_forward_context enter+exit against the floor of a bare ContextVar swap.

Run from the repository root:

    .venv/bin/python bench/forward_context_bench.py [--iterations N] [--repeats R]

Every case is timed in the same run, as ``R`` rounds of ``N`` enter+exit pairs; the table
gives the best and the median round per pair and the ratio of the median to the floor.

Cases:
    floor (class CM)      a class-based context manager that sets a ContextVar on enter
                          and resets it on exit: the least any forward context can cost.
    floor (@contextmanager) the same swap as a generator context manager, which is how
                          set_forward_context is written (and what the bindings detect).
    set_forward_context, DP off
    set_forward_context, DP off, FULL graph (builds the default BatchDescriptor)
    set_forward_context, DP on, given counts (2 ranks; builds DPMetadata from a tensor)
"""

import argparse
import contextvars
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from vllm_bridge.config import ParallelConfig, VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import set_forward_context

_var: contextvars.ContextVar[object | None] = contextvars.ContextVar("bench", default=None)
_VALUE = object()


class _Swap:
    """Bare class-based context manager: set a ContextVar, reset it on exit."""

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _var.set(_VALUE)

    def __exit__(self, *exc: object) -> None:
        _var.reset(self._token)


@contextmanager
def _swap_gen() -> Iterator[None]:
    token = _var.set(_VALUE)
    try:
        yield
    finally:
        _var.reset(token)


def _time_round(make_cm: Callable[[], object], iterations: int) -> float:
    """Seconds per enter+exit pair over one round."""
    start = time.perf_counter()
    for _ in range(iterations):
        with make_cm():  # type: ignore[attr-defined]
            pass
    return (time.perf_counter() - start) / iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20_000, help="pairs per round")
    parser.add_argument("--repeats", type=int, default=7, help="rounds per case")
    args = parser.parse_args()

    plain = VllmConfig()
    dp_on = VllmConfig(parallel_config=ParallelConfig(data_parallel_size=2, data_parallel_rank=0))
    counts = torch.tensor([256, 200], dtype=torch.int32)
    attn = {"layer.0": object()}

    cases: list[tuple[str, Callable[[], object]]] = [
        ("floor (class CM, ContextVar swap)", _Swap),
        ("floor (@contextmanager, ContextVar swap)", _swap_gen),
        ("set_forward_context, DP off", lambda: set_forward_context(attn, plain, num_tokens=256)),
        (
            "set_forward_context, DP off, FULL graph",
            lambda: set_forward_context(
                attn, plain, num_tokens=256, cudagraph_runtime_mode=CUDAGraphMode.FULL
            ),
        ),
        (
            "set_forward_context, DP on (2 ranks), given counts",
            lambda: set_forward_context(attn, dp_on, num_tokens=256, num_tokens_across_dp=counts),
        ),
    ]

    for _, make_cm in cases:  # warm up
        _time_round(make_cm, min(args.iterations, 2_000))
    results = []
    for name, make_cm in cases:
        rounds = [_time_round(make_cm, args.iterations) for _ in range(args.repeats)]
        results.append((name, min(rounds), statistics.median(rounds)))

    floor = results[0][2]
    print(f"torch {torch.__version__}; {args.repeats} rounds x {args.iterations} enter+exit")
    print(f"{'case':<52} {'best us':>8} {'median us':>10} {'x floor':>8}")
    for name, best, median in results:
        print(f"{name:<52} {best * 1e6:>8.2f} {median * 1e6:>10.2f} {median / floor:>8.1f}")


if __name__ == "__main__":
    main()
