"""Benchmark: micro-batches overlapped on two threads against run one after the other
(issue 17), DP=2 MoE steps of the demo model.

Run from the repository root (part 8 of ``make bench``):

    .venv/bin/python bench/ubatch_bench.py [--steps N] [--warmup W] [--repeats R]
                                           [--tokens T] [--prompt P] [--threads K]
                                           [--no-cuda]

Two spawned processes are DP ranks 0 and 1 over a real gloo group. Each builds two
runners from the same weights, ``ubatch_overlap=True`` (UBatchWrapper: two threads taking
turns at the MoE collectives) and ``False`` (the micro-batches one after the other), and
runs, alternately per repeat, ``W`` warm-up then ``N`` timed steps of each: every step is
a prefill of ``T`` tokens per rank (``T/P`` new requests of ``P`` tokens, ``--prompt``,
default 8; the previous step's requests finish), micro-batched into two halves. Short
prompts keep the demo attention's key window (one gather of the sequence's keys per
token, memory-bound on a CPU) small beside the collectives. The figure is the median step time
(``StepOutput.step_ms``) of each runner per repeat; the ratio is sequential / overlapped
(above 1: the overlap is faster), with the range over repeats. Beside the wall time, the
CPU time a rank's process used per step (all its threads, ``time.process_time``): when
the two modes use the same CPU and differ in wall time, the difference is waiting.

Configuration ("comm-heavy"): hidden 512, 4 experts of intermediate 32, top-4, 2
layers, expert parallelism (each MoE layer all-gathers the tokens and all-reduces the
experts' contributions, ``tokens x 2 ranks x top_k x hidden`` floats), one MoE chunk per
micro-batch. The experts are narrow, so the collectives are a large share of the step:
the script measures that share on the sequential runner (time inside the collectives /
step time) and prints it.

On CUDA (when available, unless ``--no-cuda``) the same runs with both ranks on the GPU(s)
(rank mod device count), collectives over gloo through the CPU. Target (issue 17, GPU):
overlap at least 1.15x faster than sequential. Without a CUDA device that part prints
``cuda: skipped: needs a CUDA device``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

TARGET = 1.15
MODEL = {
    "hidden_size": 512,
    "intermediate_size": 32,
    "num_experts": 4,
    "top_k": 4,
    "num_layers": 2,
    "num_heads": 8,
    "max_model_len": 64,
    "vocab_size": 512,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step(n: int, tokens: int, rank: int, prompt: int) -> dict[str, Any]:
    """Step ``n`` of a rank: ``tokens / prompt`` new prefills of ``prompt`` tokens each;
    the previous step's requests finish."""
    count = tokens // prompt
    new = {f"r{rank}-{n}-{i}": [(7 * n + 3 * i + j) % 500 for j in range(prompt)]
           for i in range(count)}
    finished = [f"r{rank}-{n - 1}-{i}" for i in range(count)] if n else []
    return {"num_scheduled_tokens": {r: prompt for r in new}, "new_requests": new,
            "finished": finished}


def _rank(conn: Any, rank: int, port: int, args: dict[str, Any], path: str, device: str) -> None:
    from vllm_bridge import dp
    from vllm_bridge.config import CompilationConfig, ParallelConfig, VllmConfig
    from vllm_bridge.demo.batch import SchedulerStep
    from vllm_bridge.demo.model import moe as moe_module
    from vllm_bridge.demo.model_runner import ModelRunner

    torch.set_num_threads(args["threads"])
    dp.init_dp_group(rank, 2, "127.0.0.1", port, "gloo", 60.0)
    comm = {"on": False, "s": 0.0}

    def timed(fn: Any) -> Any:
        def call(*a: Any) -> Any:
            if not comm["on"]:
                return fn(*a)
            t0 = time.perf_counter()
            try:
                return fn(*a)
            finally:
                comm["s"] += time.perf_counter() - t0
        return call

    # The MoE layer's collectives, timed on the sequential runner (where a collective's
    # time is all waiting: nothing else runs meanwhile).
    moe_module.dp_all_gather = timed(moe_module.dp_all_gather)
    moe_module.dp_all_reduce = timed(moe_module.dp_all_reduce)
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
    runners = {}
    for overlap in (False, True):
        config = VllmConfig(
            parallel_config=ParallelConfig(
                data_parallel_size=2, data_parallel_rank=rank, is_moe_model=True,
                enable_expert_parallel=True, enable_dbo=True,
                dbo_prefill_token_threshold=8, dbo_decode_token_threshold=2,
            ),
            compilation_config=CompilationConfig(cudagraph_mode="none"),
        )
        runner = ModelRunner(config, device=device,
                             max_num_reqs=2 * args["tokens"] // args["prompt"],
                             moe_chunk_size=args["tokens"] // 2, ubatch_overlap=overlap)
        runner.load_model(path)
        runners[overlap] = runner
    counters = {False: 0, True: 0}
    result: dict[str, Any] = {"seq": [], "over": [], "share": [], "ran": set(),
                              "cpu_seq": [], "cpu_over": []}
    try:
        for _ in range(args["repeats"]):
            for overlap in (False, True):
                runner = runners[overlap]
                times, shares, cpu = [], [], []
                for i in range(args["warmup"] + args["steps"]):
                    n = counters[overlap]
                    counters[overlap] += 1
                    comm["s"] = 0.0
                    comm["on"] = not overlap
                    step = _step(n, args["tokens"], rank, args["prompt"])
                    cpu0 = time.process_time()
                    out = runner.execute_model(SchedulerStep(**step))
                    cpu_ms = (time.process_time() - cpu0) * 1e3
                    comm["on"] = False
                    result["ran"].add(out.ubatch_run)
                    if i >= args["warmup"]:
                        times.append(out.step_ms)
                        shares.append(comm["s"] * 1e3 / out.step_ms)
                        cpu.append(cpu_ms)
                result["over" if overlap else "seq"].append(statistics.median(times))
                result["cpu_over" if overlap else "cpu_seq"].append(statistics.median(cpu))
                if not overlap:
                    result["share"].append(statistics.median(shares))
        conn.send(("ok", result))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        dp.destroy_dp_group()


def _run(args: dict[str, Any], path: str, device: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    conns, procs = [], []
    for rank in range(2):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank, args=(child, rank, port, args, path, device))
        proc.start()
        conns.append(parent)
        procs.append(proc)
    results = []
    for rank, conn in enumerate(conns):
        if not conn.poll(1800):
            raise SystemExit(f"rank {rank} gave no result within 30 minutes")
        status, value = conn.recv()
        if status != "ok":
            raise SystemExit(f"rank {rank}: {value}")
        results.append(value)
    for proc in procs:
        proc.join(30)
    return results[0]


def _report(name: str, res: dict[str, Any], judge: bool) -> list[str]:
    ratios = [s / o for s, o in zip(res["seq"], res["over"])]
    fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    lines = [
        f"{name}: sequential step median {statistics.median(res['seq']):.1f} ms "
        f"(repeats: {fmt(res['seq'])})",
        f"{name}: overlapped step median {statistics.median(res['over']):.1f} ms "
        f"(repeats: {fmt(res['over'])})",
        f"{name}: sequential / overlapped {statistics.median(ratios):.2f}x "
        f"(range {min(ratios):.2f}-{max(ratios):.2f}x); collectives "
        f"{100 * statistics.median(res['share']):.0f}% of the sequential step; ran: "
        f"{', '.join(sorted(str(r) for r in res['ran']))}",
        f"{name}: process CPU time per step (rank 0, all its threads): sequential "
        f"{statistics.median(res['cpu_seq']):.1f} ms, overlapped "
        f"{statistics.median(res['cpu_over']):.1f} ms",
    ]
    if judge:
        verdict = "met" if statistics.median(ratios) >= TARGET else "NOT met"
        lines.append(f"target {name}: overlap >= {TARGET}x sequential: "
                     f"{statistics.median(ratios):.2f}x -- {verdict}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="per rank per step, a multiple of 8")
    parser.add_argument("--prompt", type=int, default=8, help="tokens per request")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--no-cuda", action="store_true")
    ns = parser.parse_args(argv)
    for name in ("steps", "repeats", "threads"):
        if getattr(ns, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(ns, name)}")
    if ns.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {ns.warmup}")
    if ns.tokens < 8 or ns.tokens % 8:
        parser.error(f"--tokens must be a multiple of 8 (>= 8), got {ns.tokens}")
    if ns.prompt < 1 or ns.tokens % ns.prompt or ns.prompt > MODEL["max_model_len"]:
        parser.error(f"--prompt must divide --tokens and be <= {MODEL['max_model_len']}, "
                     f"got {ns.prompt}")
    args = vars(ns)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from vllm_bridge.demo.rank import save_weights

    print(f"micro-batch overlap, DP=2 over gloo, comm-heavy config {MODEL}, EP on; "
          f"{ns.tokens} tokens per rank per step (2 micro-batches of {ns.tokens // 2}); "
          f"{ns.steps} steps after {ns.warmup} warm-up, {ns.repeats} repeats; "
          f"torch threads per rank {ns.threads}; host CPUs {mp.cpu_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = save_weights(str(Path(tmp) / "moe.pt"), seed=3, model=MODEL)["path"]
        for line in _report("cpu", _run(args, path, "cpu"), judge=False):
            print(line)
        if ns.no_cuda or not torch.cuda.is_available():
            print("cuda: skipped: needs a CUDA device")
        else:
            for line in _report("cuda", _run(args, path, "cuda"), judge=True):
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
