"""Two DP ranks in spawned processes over a real gloo group, driving a ModelRunner each:
the harness of the micro-batch overlap tests (and of ``bench/ubatch_bench.py``).

``Ranks().run(path, runner_kwargs, steps_per_rank, inject=...)`` makes each rank create a
fresh :class:`~vllm_bridge.demo.model_runner.ModelRunner`, load the weights and run its
steps, going on after a failed one. Each rank answers with a :class:`RankReply`: per step
its output or its error, the hand-over points its
micro-batch threads passed (recorded by a fault injector that acts only at the points
``inject`` names, on the ranks it names) and the threads alive afterwards.

``inject``: ``{"rank": r, "point": p}`` or ``{"points": {r: p, ...}}``; with
``"signal": True`` the fault is not an exception in the micro-batch thread but SIGINT sent
to the rank's main thread (a ``KeyboardInterrupt`` there, as the worker's cancel raises
``CallInterrupted``), the thread holding its turn until the main thread has failed the run.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

REPLY_GUARD_S = 120.0  # a hung rank fails the test instead of hanging it
# A collective's own limit (gloo): only a safety net here (a failure ends the step on both
# ranks through the abort, not through this timeout), so it is generous: at 20 s, two
# collectives of a loaded 2-core box (load 5-7) timed out in a run that was otherwise fine.
GROUP_TIMEOUT_S = 60.0


class InjectedFault(RuntimeError):
    """Raised by the test's fault injector at the chosen hand-over point."""


@dataclass
class RankReply:
    outputs: list[dict[str, Any] | None] = field(default_factory=list)
    errors: list[tuple[str, str] | None] = field(default_factory=list)  # (type, message)
    points: list[tuple[int, int, str, str]] = field(default_factory=list)
    threads: list[str] = field(default_factory=list)
    setup_error: str | None = None


def free_port() -> int:
    """A TCP port free on loopback just now (also for the other DP tests of this folder)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step_dict(out: Any) -> dict[str, Any]:
    return {
        "req_ids": out.req_ids,
        "sampled_token_ids": out.sampled_token_ids,
        "logits": out.logits,
        "should_ubatch": out.should_ubatch,
        "ubatch_run": out.ubatch_run,
        "ubatch_num_tokens": out.ubatch_num_tokens,
        "num_tokens_padded": out.num_tokens_padded,
        "step_ms": out.step_ms,
        "forward_ms": out.forward_ms,
    }


def _points(inject: dict[str, Any] | None, rank: int) -> Any:
    """The hand-over point ``inject`` names for ``rank`` (``None``: none)."""
    if inject is None:
        return None
    if "points" in inject:
        return inject["points"].get(rank)
    return inject["point"] if inject["rank"] == rank else None


def _interrupt_main_thread() -> None:
    """SIGINT to the main thread; hold the turn until it has failed the run (bounded)."""
    from vllm_bridge.ubatching import current_ubatch_context

    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    run = current_ubatch_context().run
    deadline = time.monotonic() + REPLY_GUARD_S / 4
    while run.error is None and time.monotonic() < deadline:
        time.sleep(0.005)


def _serve(
    conn: Connection, rank: int, port: int, threads: int, backend: str = "gloo"
) -> None:
    from vllm_bridge import dp
    from vllm_bridge.config import CompilationConfig, ParallelConfig, VllmConfig
    from vllm_bridge.demo.batch import SchedulerStep
    from vllm_bridge.demo.model_runner import ModelRunner
    from vllm_bridge.ubatching import set_fault_injector

    torch.set_num_threads(threads)
    dp.init_dp_group(rank, 2, "127.0.0.1", port, backend, GROUP_TIMEOUT_S)
    try:
        while (msg := conn.recv()) is not None:
            path, kwargs, steps, inject = msg
            reply = RankReply()

            fired = []
            step_now = [0]
            target = _points(inject, rank)
            by_signal = bool(inject and inject.get("signal"))

            def injector(point: Any) -> None:
                key = (point.ubatch_id, point.index, point.where, point.what)
                reply.points.append(key)
                # Only in the first step, once: a point this rank did not reach there
                # (another failure stopped it first) is not hit in the next step.
                if fired or step_now[0] != 0 or target is None or tuple(target) != key:
                    return
                fired.append(key)
                if by_signal:
                    _interrupt_main_thread()
                    return
                raise InjectedFault(f"injected on DP rank {rank} at {key}")

            kwargs = dict(kwargs)
            device = kwargs.pop("device", "cpu")
            if device == "cuda":
                device = f"cuda:{rank % torch.cuda.device_count()}"
            parallel = ParallelConfig(
                data_parallel_size=2,
                data_parallel_rank=rank,
                is_moe_model=True,
                enable_expert_parallel=kwargs.pop("enable_expert_parallel", True),
                enable_dbo=True,
                dbo_prefill_token_threshold=kwargs.pop("dbo_prefill_token_threshold", 8),
                dbo_decode_token_threshold=kwargs.pop("dbo_decode_token_threshold", 2),
            )
            config = VllmConfig(
                parallel_config=parallel,
                compilation_config=CompilationConfig(cudagraph_mode="none"),
            )
            set_fault_injector(injector)
            try:
                runner = ModelRunner(config, device=device, **kwargs)
                runner.load_model(path)
                for index, step in enumerate(steps):
                    step_now[0] = index
                    try:
                        out = runner.execute_model(SchedulerStep(**step))
                        reply.outputs.append(_step_dict(out))
                        reply.errors.append(None)
                    # BaseException: an injected interrupt (KeyboardInterrupt) is a result too.
                    except BaseException as exc:  # reported to the test, which judges it
                        reply.outputs.append(None)
                        reply.errors.append((type(exc).__name__, str(exc)))
            except Exception as exc:
                reply.setup_error = f"{type(exc).__name__}: {exc}"
            finally:
                set_fault_injector(None)
            reply.threads = [t.name for t in threading.enumerate()]
            conn.send(reply)
    finally:
        dp.destroy_dp_group()


class Ranks:
    """Two rank processes, alive until :meth:`close`."""

    def __init__(self, threads: int = 1, backend: str = "gloo") -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve, args=(child, rank, port, threads, backend), daemon=True
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(
        self,
        path: str,
        kwargs: dict[str, Any],
        steps: list[list[dict[str, Any]]],
        inject: dict[str, Any] | None = None,
    ) -> list[RankReply]:
        """``steps[rank]``: that rank's steps (``SchedulerStep`` fields); one reply per rank."""
        for rank, conn in enumerate(self.conns):
            conn.send((path, kwargs, steps[rank], inject))
        replies = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(REPLY_GUARD_S):
                raise AssertionError(f"rank {rank} gave no reply within {REPLY_GUARD_S} s")
            replies.append(conn.recv())
        return replies

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
