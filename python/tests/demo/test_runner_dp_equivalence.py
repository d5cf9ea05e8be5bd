"""A data-parallel run of the MoE model equals one rank running the same tokens.

Two spawned processes are DP ranks 0 and 1 over a real gloo group (alive for the whole
module). Each runs ``vllm_bridge.demo.rank`` through a seeded multi-step schedule with uneven
token counts; the test process runs the merged schedule on one rank without DP. Every
request must get the same tokens, step for step, and logits equal within 1e-5 (the
model is built so that a token's result does not depend on its batch; see
``vllm_bridge.demo.model.moe``).
"""

import multiprocessing as mp
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from runner_schedules import RankStep, make_schedule, merge
from ubatch_ranks import free_port
from vllm_bridge.demo.batch import SchedulerStep
from vllm_bridge.config import CompilationConfig, ParallelConfig, VllmConfig
from vllm_bridge.demo.model_runner import ModelRunner
from vllm_bridge.demo.rank import DEFAULT_CAPTURE_SIZES, save_weights

REPLY_GUARD_S = 120.0  # a hung rank fails the test instead of hanging it
STEPS = 7
MODEL = {"num_layers": 2, "max_model_len": 128}


def _rank_main(conn: Connection, rank: int, port: int) -> None:
    from vllm_bridge import dp
    from vllm_bridge.demo import rank as runner

    torch.set_num_threads(1)
    dp.init_dp_group(rank, 2, "127.0.0.1", port, "gloo", 60.0)
    try:
        while (msg := conn.recv()) is not None:
            path, kwargs, steps = msg
            try:
                runner.create_runner(device="cpu", model=MODEL, **kwargs)
                runner.load_model(path)
                conn.send(("ok", [runner.execute_model(**vars(s)) for s in steps]))
            except Exception as exc:  # reported to the test, which fails on it
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            finally:
                runner.shutdown_runner()
    finally:
        dp.destroy_dp_group()


class Ranks:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(child, rank, port), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, path: str, kwargs: dict, schedule: list[list[RankStep]]) -> list[list[dict]]:
        """Both ranks run the schedule; ``out[rank][step]``."""
        for rank, conn in enumerate(self.conns):
            conn.send((path, kwargs, [row[rank] for row in schedule]))
        outs = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(REPLY_GUARD_S):
                raise AssertionError(f"rank {rank} gave no reply within {REPLY_GUARD_S} s")
            status, value = conn.recv()
            assert status == "ok", f"rank {rank}: {value}"
            outs.append(value)
        return outs

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    pair = Ranks()
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("weights") / "moe.pt"
    return save_weights(str(path), seed=11, model=MODEL)["path"]


def _reference(path: str, schedule: list[list[RankStep]]) -> list[dict[str, Any]]:
    """The merged schedule on one rank without DP."""
    config = VllmConfig(
        parallel_config=ParallelConfig(is_moe_model=True),
        compilation_config=CompilationConfig(
            cudagraph_mode="full_and_piecewise", cudagraph_capture_sizes=list(DEFAULT_CAPTURE_SIZES)
        ),
    )
    runner = ModelRunner(config, device="cpu")
    runner.load_model(path)
    outs = []
    for row in schedule:
        out = runner.execute_model(SchedulerStep(**vars(merge(row))))
        outs.append({r: (t, out.logits[i]) for i, (r, t) in
                     enumerate(zip(out.req_ids, out.sampled_token_ids))})
    return outs


def _assert_same_tokens(dp_outs: list[list[dict]], ref: list[dict[str, Any]]) -> int:
    """Every request's token (and logits) of every step, DP against the reference."""
    compared = 0
    for step, expected in enumerate(ref):
        got: dict[str, Any] = {}
        for rank in range(2):
            out = dp_outs[rank][step]
            for i, (req, token) in enumerate(zip(out["req_ids"], out["sampled_token_ids"])):
                got[req] = (token, out["logits"][i])
        assert set(got) == set(expected), f"step {step}: requests {sorted(got)} vs {sorted(expected)}"
        for req, (token, logits) in expected.items():
            assert got[req][0] == token, f"step {step}, request {req}: token {got[req][0]} != {token}"
            torch.testing.assert_close(got[req][1], logits, rtol=1e-5, atol=1e-5)
            compared += 1
    return compared


def _lockstep_facts(dp_outs: list[list[dict]]) -> None:
    """Both ranks agreed on counts, micro-batching, mode and chunks in every step."""
    keys = ("num_tokens_across_dp", "should_ubatch", "cudagraph_mode", "moe_chunks", "skipped")
    for step, (a, b) in enumerate(zip(*dp_outs)):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, f"step {step}"


def test_dp_with_expert_parallelism_matches_one_rank(ranks: Ranks, weights: str) -> None:
    schedule = make_schedule(seed=5, num_steps=STEPS)
    dp_outs = ranks.run(weights, {"enable_expert_parallel": True}, schedule)
    assert _assert_same_tokens(dp_outs, _reference(weights, schedule)) >= 10
    _lockstep_facts(dp_outs)
    rank0, rank1 = dp_outs
    # The schedule is uneven, so padding happened; rank 1 idled in step 2 (a dummy pass).
    assert any(o["num_tokens_padded"] > o["num_tokens"] for o in rank0 + rank1)
    assert rank1[2]["num_tokens"] == 0 and rank1[2]["num_tokens_across_dp"][0] > 0
    assert any(o["moe_chunks"] > 1 for o in rank0), "no step walked more than one MoE chunk"


def test_dp_with_micro_batching_and_replicated_experts_matches_one_rank(
    ranks: Ranks, weights: str
) -> None:
    schedule = make_schedule(seed=8, num_steps=STEPS)
    kwargs = {
        "enable_expert_parallel": False,
        "enable_dbo": True,
        "dbo_prefill_token_threshold": 8,
        "dbo_decode_token_threshold": 2,
    }
    dp_outs = ranks.run(weights, kwargs, schedule)
    assert _assert_same_tokens(dp_outs, _reference(weights, schedule)) >= 10
    _lockstep_facts(dp_outs)
    ubatched = [o for o in dp_outs[0] if o["should_ubatch"]]
    assert ubatched, "no step was micro-batched"
    assert all(sum(o["ubatch_num_tokens"]) == o["num_tokens_padded"] for o in ubatched)


def test_a_rank_that_skips_coordination_is_reported_not_hung(tmp_path: Path) -> None:
    # Not a DP run: a runner configured for 2 ranks in a process that joined no group
    # must refuse at once (the first collective of a step is coordinate_batch_across_dp).
    path = save_weights(str(tmp_path / "w.pt"), seed=1, model=MODEL)["path"]
    config = VllmConfig(parallel_config=ParallelConfig(data_parallel_size=2, is_moe_model=True))
    runner = ModelRunner(config, device="cpu")
    runner.load_model(path)
    with pytest.raises(RuntimeError, match="has not joined a DP group"):
        runner.execute_model(SchedulerStep({"a": 2}, {"a": [1, 2]}))
