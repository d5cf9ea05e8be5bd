"""Benchmark: CUDA-graph replay against eager, per step of the demo model (issue 16).

Run from the repository root (part 7 of ``make bench``):

    .venv/bin/python bench/cudagraph_bench.py [--steps N] [--warmup W] [--cpu]

Without a CUDA device it prints ``skipped: needs a CUDA device`` and exits 0. ``--cpu``
runs the same cases on the CPU, where the graph manager only emulates replay: it checks
the script, its figures say nothing about graphs.

Cases (the default demo model, one rank, no DP; capture sizes 1, 2, 4, 8, 16):

    decode 1, 2, 4, 8   that many running requests, one token each (uniform decode)
    mixed 3+3           3 decodes and a 3-token prefill chunk: 6 tokens, padded to 8

each under three runners built from the same weights: ``none`` (eager), ``piecewise``
(PIECEWISE graphs: the dense pieces captured, attention and the MoE routing's
collectives between them run eagerly) and ``full_and_piecewise`` (FULL graphs for the
uniform decodes, PIECEWISE for the mixed batch). A case's steps are timed one by one:
``torch.cuda.synchronize`` before and after each ``execute_model``, the median of ``N``
steps after ``W`` warm-up steps. Two figures per step: the whole step (host input
preparation, forward, logits, greedy sampling, the copy of the logits to the host) and
its forward part (``StepOutput.forward_ms``, which the runner also ends with a device
synchronize). Capture time and memory come from the graph manager's report.

Target (issue 16): on an H100, replay at least 3x faster than eager for decode batches of
8 or fewer. The ratio is printed for the forward pass (what a graph replaces) and for the
whole step; ``met`` is judged on the forward pass of each decode case's best graph mode.
"""

import argparse
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SKIP = "skipped: needs a CUDA device"
SIZES = [1, 2, 4, 8, 16]
DECODE_BATCHES = [1, 2, 4, 8]
TARGET = 3.0
MODES = ["none", "piecewise", "full_and_piecewise"]


@dataclass(frozen=True)
class Case:
    """A step shape: ``decodes`` requests of one token, plus a prefill chunk of
    ``chunk`` tokens of a long prompt when ``chunk`` > 0 (a mixed batch)."""

    name: str
    decodes: int
    chunk: int = 0


CASES = [Case(f"decode {b}", b) for b in DECODE_BATCHES] + [Case("mixed 3+3", 3, chunk=3)]


@dataclass
class Timing:
    """One case under one runner: medians in ms, and how its timed steps ran."""

    step_ms: float
    forward_ms: float
    modes: set[str]
    graphs: set[str]


def _runner(weights: str, mode: str, device: str):
    from vllm_bridge.config import CompilationConfig, ParallelConfig, VllmConfig
    from vllm_bridge.demo.model_runner import ModelRunner

    config = VllmConfig(
        parallel_config=ParallelConfig(is_moe_model=True),
        compilation_config=CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=SIZES),
    )
    runner = ModelRunner(config, device=device)
    runner.load_model(weights)
    return runner


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_case(runner, case: Case, steps: int, warmup: int, device: str, round_: int) -> Timing:
    """Start the case's requests (untimed), then run ``warmup + steps`` steps of its
    shape, timing the last ``steps``; finish the requests afterwards."""
    from vllm_bridge.demo.batch import SchedulerStep

    max_len = runner.model_config.max_model_len
    vocab = runner.model_config.vocab_size
    total = warmup + steps
    decodes = [f"c{round_}-d{i}" for i in range(case.decodes)]
    prompts = {r: [(7 * i + 3) % vocab, (5 * i + 1) % vocab] for i, r in enumerate(decodes)}
    prefill = f"c{round_}-p" if case.chunk else None
    if prefill is not None:
        # A prompt long enough for every timed chunk; its first chunk runs untimed.
        length = case.chunk * (total + 1)
        if length > max_len:
            raise ValueError(f"{case.name}: {total} steps need a {length}-token prompt, "
                             f"the model holds {max_len}: lower --steps/--warmup")
        prompts[prefill] = [(11 * i + 2) % vocab for i in range(length)]
    if 2 + total > max_len:
        raise ValueError(f"{case.name}: {total} steps exceed max_model_len {max_len}")
    first = {r: 2 for r in decodes}
    if prefill is not None:
        first[prefill] = case.chunk
    runner.execute_model(SchedulerStep(first, prompts))
    shape = {r: 1 for r in decodes}
    if prefill is not None:
        shape[prefill] = case.chunk
    step_ms, forward_ms, modes, graphs = [], [], set(), set()
    for i in range(total):
        _sync(device)
        start = time.perf_counter()
        out = runner.execute_model(SchedulerStep(dict(shape)))
        _sync(device)
        elapsed = (time.perf_counter() - start) * 1e3
        if i >= warmup:
            step_ms.append(elapsed)
            forward_ms.append(out.forward_ms)
            modes.add(out.cudagraph_mode)
            graphs.add(out.graph)
    runner.execute_model(SchedulerStep({}, finished=list(prompts)))
    return Timing(statistics.median(step_ms), statistics.median(forward_ms), modes, graphs)


def _device_line(device: str) -> str:
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        return (f"device: {props.name} ({props.total_memory / 2**30:.0f} GiB), "
                f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
                f"Python {platform.python_version()}")
    return (f"device: cpu ({platform.processor() or platform.machine()}) -- graphs emulated, "
            f"figures mean nothing; torch {torch.__version__}, Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="timed steps per case (median)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before them")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (checks the script)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps}, {args.warmup}")
    if args.cpu:
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        print(SKIP)
        return 0

    from vllm_bridge.demo.model.config import ModelConfig
    from vllm_bridge.demo.model.weights import save_weights

    print(_device_line(device))
    print(f"demo model {ModelConfig()}; capture sizes {SIZES}; "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    results: dict[tuple[str, str], Timing] = {}
    with tempfile.TemporaryDirectory() as tmp:
        weights = save_weights(Path(tmp) / "w.pt", ModelConfig(), seed=0).path
        for mode in MODES:
            runner = _runner(weights, mode, device)
            report = runner.graphs.report
            if mode != "none":
                memory = ("n/a" if report.memory_bytes is None
                          else f"{report.memory_bytes / 2**20:.1f} MiB")
                print(f"capture {mode}: {len(report.captured)} descriptors, "
                      f"{report.num_graphs} CUDA graphs, {report.seconds * 1e3:.0f} ms, "
                      f"memory {memory}")
            for round_, case in enumerate(CASES):
                results[(case.name, mode)] = _time_case(
                    runner, case, args.steps, args.warmup, device, round_
                )
            del runner
    print()
    header = (f"{'case':<11} {'runner':<19} {'mode':<10} {'ran':<9} "
              f"{'step ms':>8} {'fwd ms':>8} {'x eager step':>13} {'x eager fwd':>12}")
    print(header)
    print("-" * len(header))
    verdicts = []
    for case in CASES:
        eager = results[(case.name, "none")]
        best = 0.0
        for mode in MODES:
            t = results[(case.name, mode)]
            ratio_step = eager.step_ms / t.step_ms
            ratio_fwd = eager.forward_ms / t.forward_ms
            if mode != "none" and t.graphs <= {"replay"}:
                best = max(best, ratio_fwd)
            print(f"{case.name:<11} {mode:<19} {'/'.join(sorted(t.modes)):<10} "
                  f"{'/'.join(sorted(t.graphs)):<9} {t.step_ms:>8.3f} {t.forward_ms:>8.3f} "
                  f"{ratio_step:>12.2f}x {ratio_fwd:>11.2f}x")
        if case.chunk == 0:
            verdicts.append((case.name, best))
    print()
    for name, best in verdicts:
        met = "met" if best >= TARGET else "NOT met"
        if device == "cpu":
            met = "n/a (no CUDA: replay emulated)"
        print(f"target {name}: replay >= {TARGET:.0f}x eager (forward): best {best:.2f}x -- {met}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
