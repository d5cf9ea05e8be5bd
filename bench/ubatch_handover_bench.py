"""Benchmark: what one hand-over costs in a micro-batched run (issue 17), in one process.

Run from the repository root:

    .venv/bin/python bench/ubatch_handover_bench.py [--layers L] [--calls C] [--repeats R]

A UBatchWrapper on the CPU runs a model of ``L`` layers (default 32) whose every layer
launches a stand-in collective that has already completed and has no future (as a work
object without ``get_future`` is), hands over and waits on it: 2 x L collectives per
call, no compute to speak of. Prints the median wall time per call and per collective over
``C`` calls (default 20), ``R`` times (default 3). What it shows: the fixed cost of the
turn-taking and of waiting on a collective that is already complete.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from vllm_bridge.config import ParallelConfig, VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import create_forward_context, override_forward_context
from vllm_bridge.ubatch import UBatchSlice
from vllm_bridge.ubatch_wrapper import UBatchWrapper
from vllm_bridge.ubatching import current_ubatch_context


class _Complete:
    """A collective's work that has completed and offers no future."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Model:
    def __init__(self, layers: int) -> None:
        self.layers = layers

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = current_ubatch_context()
        x = input_ids.float()
        for _ in range(self.layers):
            work = ctx.launch("bench", _Complete)
            ctx.handover("bench")
            ctx.wait("bench", work, 5.0)
            x = x + 1
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = VllmConfig(parallel_config=ParallelConfig(is_moe_model=True))
    slices = [UBatchSlice(slice(0, 1), slice(0, 4)), UBatchSlice(slice(1, 2), slice(4, 8))]
    context = create_forward_context([None, None], config, ubatch_slices=slices)
    wrapper = UBatchWrapper(_Model(args.layers), config, CUDAGraphMode.NONE, "cpu")
    inputs = {"input_ids": torch.arange(8), "positions": torch.arange(8)}
    collectives = 2 * args.layers
    for repeat in range(args.repeats):
        times = []
        with override_forward_context(context):
            for _ in range(args.calls):
                start = time.perf_counter()
                wrapper(**inputs)
                times.append(time.perf_counter() - start)
        per_call = statistics.median(times) * 1e3
        print(f"repeat {repeat + 1}: {per_call:.2f} ms per call, "
              f"{per_call / collectives * 1e3:.0f} us per collective ({collectives} collectives)")


if __name__ == "__main__":
    main()
