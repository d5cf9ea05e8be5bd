"""Micro-batches that overlap on two threads (UBatchWrapper) over a real 2-rank gloo group.

* Same answers: the overlapped run gives every request the tokens of the sequential
  micro-batched run and of one rank running the merged schedule, logits within 1e-5.
* The hand-over really happens, in the same order on both ranks: micro-batch 1 issues its
  first collective before micro-batch 0 waits on its own.
* Failure never hangs: an exception injected at every hand-over point, in either thread,
  on either rank, ends the step with that error on both ranks, leaves no micro-batch
  thread behind, and the next step of the same runners gives the right tokens.
"""

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from runner_schedules import make_schedule, merge
from ubatch_ranks import RankReply, Ranks
from vllm_bridge.config import CompilationConfig, ParallelConfig, VllmConfig
from vllm_bridge.demo.batch import SchedulerStep
from vllm_bridge.demo.model_runner import ModelRunner
from vllm_bridge.demo.rank import save_weights

MODEL = {"num_layers": 2, "max_model_len": 128}
STEPS = 6


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
    return save_weights(str(path), seed=13, model=MODEL)["path"]


def _one_rank(
    path: str, merged_steps: list[dict[str, Any]], device: str = "cpu"
) -> list[dict[str, tuple]]:
    """The merged schedule on one rank without DP: ``{req: (token, logits)}`` per step."""
    config = VllmConfig(
        parallel_config=ParallelConfig(is_moe_model=True),
        compilation_config=CompilationConfig(cudagraph_mode="none"),
    )
    runner = ModelRunner(config, device=device)
    runner.load_model(path)
    outs = []
    for step in merged_steps:
        out = runner.execute_model(SchedulerStep(**step))
        outs.append({r: (t, out.logits[i]) for i, (r, t) in
                     enumerate(zip(out.req_ids, out.sampled_token_ids))})
    return outs


def _by_request(replies: list[RankReply], step: int) -> dict[str, tuple]:
    got = {}
    for reply in replies:
        out = reply.outputs[step]
        assert out is not None, f"step {step} failed: {reply.errors[step]}"
        for i, (req, token) in enumerate(zip(out["req_ids"], out["sampled_token_ids"])):
            got[req] = (token, out["logits"][i])
    return got


def _assert_same(got: dict[str, tuple], expected: dict[str, tuple], what: str) -> None:
    assert set(got) == set(expected), f"{what}: requests {sorted(got)} vs {sorted(expected)}"
    for req, (token, logits) in expected.items():
        assert got[req][0] == token, f"{what}, request {req}: token {got[req][0]} != {token}"
        torch.testing.assert_close(got[req][1], logits, rtol=1e-5, atol=1e-5)


def _no_ubatch_threads(replies: list[RankReply]) -> None:
    for rank, reply in enumerate(replies):
        left = [name for name in reply.threads if name.startswith("vllm-bridge-ubatch")]
        assert not left, f"rank {rank} left micro-batch threads behind: {left}"


def test_overlapped_run_matches_the_sequential_run_and_one_rank(
    ranks: Ranks, weights: str
) -> None:
    schedule = make_schedule(seed=8, num_steps=STEPS)
    per_rank = [[vars(row[r]) for row in schedule] for r in range(2)]
    overlapped = ranks.run(weights, {"ubatch_overlap": True}, per_rank)
    sequential = ranks.run(weights, {"ubatch_overlap": False}, per_rank)
    reference = _one_rank(weights, [vars(merge(row)) for row in schedule])
    ubatched = 0
    for step in range(STEPS):
        got = _by_request(overlapped, step)
        _assert_same(got, reference[step], f"step {step} vs one rank")
        _assert_same(got, _by_request(sequential, step), f"step {step} vs sequential")
        out, seq = overlapped[0].outputs[step], sequential[0].outputs[step]
        assert out["should_ubatch"] == seq["should_ubatch"]
        if out["should_ubatch"]:
            ubatched += 1
            assert (out["ubatch_run"], seq["ubatch_run"]) == ("overlapped", "sequential")
        else:
            assert out["ubatch_run"] is None
    assert ubatched >= 2, "too few micro-batched steps to compare"
    _no_ubatch_threads(overlapped)

    # The sequential path has no hand-over points; the overlapped one has the same on
    # both ranks, in the same order (gloo needs one collective order per group).
    assert sequential[0].points == [] and sequential[1].points == []
    points = overlapped[0].points
    assert points == overlapped[1].points
    assert {p[0] for p in points} == {0, 1}
    # Overlap: micro-batch 1 launched its first collective before micro-batch 0 resumed
    # to wait on its own first one.
    first_b = points.index((1, 0, "launch", "all_gather"))
    first_a_resume = points.index((0, 0, "resume", "all_gather"))
    assert points.index((0, 0, "launch", "all_gather")) < first_b < first_a_resume


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none is available here)")
def test_overlapped_run_on_cuda_matches_the_sequential_run_and_one_rank(
    ranks: Ranks, weights: str
) -> None:
    # Both ranks on the GPU(s) (rank mod device count), the collectives over gloo through
    # the CPU; each micro-batch thread computes on the compute stream and launches its
    # collectives from the comm stream.
    schedule = make_schedule(seed=8, num_steps=STEPS)
    per_rank = [[vars(row[r]) for row in schedule] for r in range(2)]
    overlapped = ranks.run(weights, {"ubatch_overlap": True, "device": "cuda"}, per_rank)
    sequential = ranks.run(weights, {"ubatch_overlap": False, "device": "cuda"}, per_rank)
    reference = _one_rank(weights, [vars(merge(row)) for row in schedule], device="cuda")
    for step in range(STEPS):
        got = _by_request(overlapped, step)
        _assert_same(got, reference[step], f"step {step} vs one rank on the GPU")
        _assert_same(got, _by_request(sequential, step), f"step {step} vs sequential")
    assert any(o["ubatch_run"] == "overlapped" for o in overlapped[0].outputs)
    _no_ubatch_threads(overlapped)


def _failing_then_next(rank: int) -> list[dict[str, Any]]:
    """A micro-batched step (two prefills), then one that drops those requests and runs
    the same prompts under new ids (so its tokens are known from a clean run)."""
    prompts = {f"a{rank}": list(range(3, 15)), f"b{rank}": list(range(40, 49))}
    first = {"num_scheduled_tokens": {r: len(p) for r, p in prompts.items()},
             "new_requests": prompts, "finished": []}
    again = {f"{r}-again": p for r, p in prompts.items()}
    second = {"num_scheduled_tokens": {r: len(p) for r, p in again.items()},
              "new_requests": again, "finished": list(prompts)}
    return [first, second]


def test_a_failure_at_any_hand_over_point_ends_the_step_on_both_ranks(
    ranks: Ranks, weights: str
) -> None:
    steps = [_failing_then_next(r) for r in range(2)]
    clean = ranks.run(weights, {}, steps)
    assert all(e is None for reply in clean for e in reply.errors), [r.errors for r in clean]
    assert clean[0].outputs[0]["ubatch_run"] == "overlapped"
    expected = {f"{req}-again": v for req, v in _by_request(clean, 0).items()}
    _assert_same(_by_request(clean, 1), expected, "clean run")
    points = list(dict.fromkeys(clean[0].points))  # distinct, in order
    # 2 layers x (all_gather, all_reduce) x (launch, resume), in each of the 2 threads.
    assert len(points) == 16 and {p[0] for p in points} == {0, 1}

    for rank in range(2):
        for point in points:
            case = f"failure on rank {rank} at {point}"
            replies = ranks.run(weights, {}, steps, inject={"rank": rank, "point": point})
            for r, reply in enumerate(replies):
                assert reply.setup_error is None, reply.setup_error
                error = reply.errors[0]
                assert error is not None, f"{case}: rank {r} finished the failed step"
                kind, message = error
                assert f"injected on DP rank {rank} at {point}" in message, f"{case}: {error}"
                assert kind == ("InjectedFault" if r == rank else "UBatchAbortedError"), case
                assert reply.errors[1] is None, f"{case}: next step failed on rank {r}: {reply.errors[1]}"
            _assert_same(_by_request(replies, 1), expected, f"{case}, next step")
            _no_ubatch_threads(replies)


def _clean_points_and_expected(ranks: Ranks, weights: str, steps: list) -> tuple[list, dict]:
    clean = ranks.run(weights, {}, steps)
    assert all(e is None for reply in clean for e in reply.errors), [r.errors for r in clean]
    expected = {f"{req}-again": v for req, v in _by_request(clean, 0).items()}
    return list(dict.fromkeys(clean[0].points)), expected


def test_an_interrupt_of_the_main_thread_at_any_hand_over_point_ends_the_step_on_both_ranks(
    ranks: Ranks, weights: str
) -> None:
    # SIGINT to one rank's main thread while a micro-batch thread is at a hand-over point:
    # a KeyboardInterrupt where the main thread waits for its threads (the worker's cancel
    # raises CallInterrupted the same way).
    steps = [_failing_then_next(r) for r in range(2)]
    points, expected = _clean_points_and_expected(ranks, weights, steps)
    for rank in range(2):
        for point in points:
            case = f"interrupt on rank {rank} at {point}"
            replies = ranks.run(
                weights, {}, steps, inject={"rank": rank, "point": point, "signal": True}
            )
            for r, reply in enumerate(replies):
                assert reply.setup_error is None, reply.setup_error
                assert reply.errors[0] is not None, f"{case}: rank {r} finished the step"
                kind, message = reply.errors[0]
                if r == rank:
                    assert kind == "KeyboardInterrupt", f"{case}: {reply.errors[0]}"
                else:
                    assert kind == "UBatchAbortedError", f"{case}: {reply.errors[0]}"
                    assert f"DP rank {rank} main thread" in message, f"{case}: {message}"
                assert reply.errors[1] is None, f"{case}: next step on rank {r}: {reply.errors[1]}"
            _assert_same(_by_request(replies, 1), expected, f"{case}, next step")
            _no_ubatch_threads(replies)


def test_both_ranks_failing_at_once_end_the_step_and_the_next_runs(
    ranks: Ranks, weights: str
) -> None:
    # A deterministic sample of the 16 x 16 pairs of points (the reviewer ran all 256).
    steps = [_failing_then_next(r) for r in range(2)]
    points, expected = _clean_points_and_expected(ranks, weights, steps)
    pairs = [(p0, p1) for p0 in points for p1 in points]
    for p0, p1 in random.Random(17).sample(pairs, 12):
        case = f"failures at {p0} on rank 0 and {p1} on rank 1"
        replies = ranks.run(weights, {}, steps, inject={"points": {0: p0, 1: p1}})
        for r, reply in enumerate(replies):
            assert reply.setup_error is None, reply.setup_error
            assert reply.errors[0] is not None, f"{case}: rank {r} finished the step"
            assert "injected on DP rank" in reply.errors[0][1], f"{case}: {reply.errors[0]}"
            assert reply.errors[1] is None, f"{case}: next step on rank {r}: {reply.errors[1]}"
        _assert_same(_by_request(replies, 1), expected, f"{case}, next step")
        _no_ubatch_threads(replies)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices (NCCL needs one GPU per rank)",
)
def test_two_ranks_over_nccl_match_the_sequential_run_and_survive_a_failure(
    weights: str,
) -> None:
    # The collectives over NCCL, launched from each thread's comm stream.
    pair = Ranks(backend="nccl")
    try:
        schedule = make_schedule(seed=8, num_steps=STEPS)
        per_rank = [[vars(row[r]) for row in schedule] for r in range(2)]
        overlapped = pair.run(weights, {"ubatch_overlap": True, "device": "cuda"}, per_rank)
        sequential = pair.run(weights, {"ubatch_overlap": False, "device": "cuda"}, per_rank)
        for step in range(STEPS):
            _assert_same(
                _by_request(overlapped, step), _by_request(sequential, step), f"step {step}"
            )
        assert any(o["ubatch_run"] == "overlapped" for o in overlapped[0].outputs)
        steps = [_failing_then_next(r) for r in range(2)]
        kwargs = {"device": "cuda"}
        clean = pair.run(weights, kwargs, steps)
        expected = {f"{req}-again": v for req, v in _by_request(clean, 0).items()}
        point = list(dict.fromkeys(clean[0].points))[3]
        failed = pair.run(weights, kwargs, steps, inject={"rank": 1, "point": point})
        assert all(reply.errors[0] is not None for reply in failed)
        # Drained, not broken (the device index is not compared across ranks).
        _assert_same(_by_request(failed, 1), expected, "next step after a failure")
        _no_ubatch_threads(failed)
    finally:
        pair.close()
