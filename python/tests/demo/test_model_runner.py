"""The model runner on one rank: what the layers see in the forward context, padding,
CUDA-graph dispatch, micro-batch metadata, batch-size stats, and bad input."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runner_schedules import make_schedule, merge
from vllm_bridge import forward_context as fc
from vllm_bridge.demo import rank as bridge_runner
from vllm_bridge.demo.batch import SchedulerStep
from vllm_bridge.config import CompilationConfig, ParallelConfig, VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.cudagraph_dispatch import dispatch_cudagraph
from vllm_bridge.demo.model.config import ModelConfig
from vllm_bridge.demo.model.layers import AttentionMetadata
from vllm_bridge.demo.model.weights import WeightsError, save_weights
from vllm_bridge.demo.model_runner import ModelRunner

MODEL = ModelConfig(num_layers=2, max_model_len=96)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_weights(tmp_path_factory.mktemp("w") / "w.pt", MODEL, seed=4).path


def _runner(path: str, mode: str = "full_and_piecewise", device: str = "cpu") -> ModelRunner:
    config = VllmConfig(
        parallel_config=ParallelConfig(is_moe_model=True),
        compilation_config=CompilationConfig(
            cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64]
        ),
    )
    runner = ModelRunner(config, MODEL, device=device)
    runner.load_model(path)
    return runner


def _run(runner: ModelRunner, seed: int = 2, steps: int = 6) -> list:
    return [runner.execute_model(SchedulerStep(**vars(merge(row))))
            for row in make_schedule(seed=seed, num_steps=steps)]


def test_layers_read_the_forward_context_the_runner_sets(weights: str) -> None:
    runner = _runner(weights)
    seen = []
    attn = runner.model.layers[0].attn

    def spy(module: torch.nn.Module, args: tuple) -> None:
        ctx = fc.get_forward_context()
        seen.append((ctx.batch_descriptor, ctx.cudagraph_runtime_mode, ctx.dp_metadata,
                     ctx.attn_metadata[attn.prefix], ctx.all_moe_layers))

    attn.register_forward_pre_hook(spy)
    out = runner.execute_model(SchedulerStep({"a": 3, "b": 2}, {"a": [5, 6, 7], "b": [8, 9]}))
    (descriptor, mode, dp_meta, meta, moe_layers), = seen
    assert descriptor == fc.BatchDescriptor(num_tokens=8, num_reqs=None, uniform=False)
    assert mode is CUDAGraphMode.PIECEWISE and dp_meta is None
    assert meta.query_start_loc == [0, 2, 5] and meta.num_actual_tokens == 5  # b (2) first
    assert moe_layers == ["layers.0.moe", "layers.1.moe"]
    assert out.num_tokens == 5 and out.num_tokens_padded == 8 and out.req_ids == ["b", "a"]
    assert not fc.is_forward_context_available()
    # a decode step of both: a uniform batch replays FULL graphs with num_reqs set
    out = runner.execute_model(SchedulerStep({"a": 1, "b": 1}))
    assert seen[-1][0] == fc.BatchDescriptor(num_tokens=2, num_reqs=2, uniform=True)
    assert seen[-1][1] is CUDAGraphMode.FULL and out.cudagraph_mode == "FULL"
    assert runner.request_tokens("a")[:3] == [5, 6, 7] and len(runner.request_tokens("a")) == 5


def test_padding_does_not_change_any_real_token(weights: str) -> None:
    padded = _run(_runner(weights, "full_and_piecewise"))
    eager = _run(_runner(weights, "none"))
    assert any(o.num_tokens_padded > o.num_tokens for o in padded)
    assert all(o.num_tokens_padded == o.num_tokens for o in eager)
    for a, b in zip(padded, eager):
        assert (a.req_ids, a.sampled_token_ids) == (b.req_ids, b.sampled_token_ids)
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)


def test_a_prompt_prefilled_in_chunks_gives_the_same_token_as_in_one_go(weights: str) -> None:
    prompt = list(range(10, 40))
    whole = _runner(weights).execute_model(SchedulerStep({"p": 30}, {"p": prompt}))
    chunked = _runner(weights)
    first = chunked.execute_model(SchedulerStep({"p": 16}, {"p": prompt}))
    assert first.req_ids == []  # mid-prompt: nothing to sample yet
    second = chunked.execute_model(SchedulerStep({"p": 14}))
    assert second.sampled_token_ids == whole.sampled_token_ids
    torch.testing.assert_close(second.logits, whole.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("mode", "tokens", "uniform", "expected"),
    [
        ("full_and_piecewise", 5, False, (CUDAGraphMode.PIECEWISE, 8)),
        ("full_and_piecewise", 4, True, (CUDAGraphMode.FULL, 4)),
        ("full_and_piecewise", 65, False, (CUDAGraphMode.NONE, 65)),
        ("full_decode_only", 5, False, (CUDAGraphMode.NONE, 5)),
        ("full_decode_only", 3, True, (CUDAGraphMode.FULL, 4)),
        ("piecewise", 33, True, (CUDAGraphMode.PIECEWISE, 64)),
        ("none", 3, True, (CUDAGraphMode.NONE, 3)),
        ("full", 0, False, (CUDAGraphMode.NONE, 0)),
    ],
)
def test_cudagraph_dispatch(mode: str, tokens: int, uniform: bool, expected: tuple) -> None:
    config = CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64])
    assert dispatch_cudagraph(config, tokens, uniform) == expected


def test_micro_batch_metadata_keeps_the_cut_requests_context() -> None:
    meta = AttentionMetadata([0, 3, 10], context_lens=[5, 0], kv_starts=[0, 96], num_actual_tokens=10)
    first, second = meta.slice(0, 6), meta.slice(6, 16)  # 16: padded batch
    assert first == AttentionMetadata([0, 3, 6], [5, 0], [0, 96], 6)
    assert second == AttentionMetadata([0, 4], [3], [96], 4)  # request 2: 3 tokens before
    with pytest.raises(ValueError, match="do not describe the same requests"):
        AttentionMetadata([0, 3], [1, 2], [0, 96], 3)


@pytest.fixture
def tracking() -> Iterator[None]:
    fc.reset_batchsize_stats()
    fc.configure_batchsize_tracking(1000.0)
    try:
        yield
    finally:
        fc.configure_batchsize_tracking(-1)
        fc.reset_batchsize_stats()


def test_batchsize_stats_count_the_padded_sizes(weights: str, tracking: None) -> None:
    runner = _runner(weights)
    runner.execute_model(SchedulerStep({"a": 3}, {"a": [1, 2, 3]}))
    for _ in range(3):
        runner.execute_model(SchedulerStep({"a": 1}))
    stats = fc.get_batchsize_stats(min_count=1)
    assert [(size, count) for size, count, _ in stats] == [(1, 3), (4, 1)]


def test_bad_steps_are_refused_by_name_and_leave_the_state_alone(weights: str) -> None:
    runner = _runner(weights)
    runner.execute_model(SchedulerStep({"a": 2}, {"a": [1, 2]}))
    with pytest.raises(ValueError, match=r"request 'a' has 1 token\(s\) to compute, 3 were"):
        runner.execute_model(SchedulerStep({"a": 3}))
    with pytest.raises(ValueError, match=r"scheduled request\(s\) \['zz'\] are not running"):
        runner.execute_model(SchedulerStep({"zz": 1}, {"b": [4]}))
    assert set(runner.requests) == {"a"}  # nothing of the refused step was applied
    with pytest.raises(ValueError, match=r"token id 512 is not in 0..511"):
        runner.execute_model(SchedulerStep({"c": 1}, {"c": [512]}))
    with pytest.raises(ValueError, match="'a' is already running"):
        runner.execute_model(SchedulerStep({}, {"a": [1]}))
    with pytest.raises(ValueError, match="beyond max_model_len 96"):
        runner.execute_model(SchedulerStep({"d": 97}, {"d": [1] * 97}))
    with pytest.raises(ValueError, match=r"request 'e' has 2 token\(s\) to compute, 3 were"):
        runner.execute_model(SchedulerStep({"e": 3}, {"e": [1, 2]}))
    assert set(runner.requests) == {"a"}
    with pytest.raises(TypeError, match="num_scheduled_tokens\\['a'\\] must be an int"):
        SchedulerStep({"a": "1"})
    with pytest.raises(ValueError, match="must be a non-empty list of token ids"):
        SchedulerStep({}, {"e": []})


def test_runner_and_weights_must_agree(weights: str, tmp_path: Path) -> None:
    other = ModelConfig(num_layers=1, max_model_len=96)
    runner = ModelRunner(VllmConfig(), other, device="cpu")
    with pytest.raises(WeightsError, match="was made for ModelConfig"):
        runner.load_model(weights)
    runner = _runner(weights)
    with pytest.raises(RuntimeError, match="a model is loaded already"):
        runner.load_model(weights)
    with pytest.raises(RuntimeError, match="no model loaded"):
        ModelRunner(VllmConfig(), MODEL).execute_model(SchedulerStep())


def test_bridge_functions_refuse_use_before_create(tmp_path: Path) -> None:
    bridge_runner.shutdown_runner()
    with pytest.raises(RuntimeError, match="call vllm_bridge.demo.rank.create_runner first"):
        bridge_runner.execute_model({"a": 1})
    info = bridge_runner.save_weights(str(tmp_path / "w.pt"), seed=1, model={"num_layers": 1})
    assert info["config"]["num_layers"] == 1
    created = bridge_runner.create_runner(device="cpu", cudagraph_mode="none")
    assert created["model"] is None and created["data_parallel_size"] == 1
    bridge_runner.load_model(info["path"])
    assert bridge_runner.runner_info()["model"]["num_layers"] == 1  # taken from the file
    out = bridge_runner.execute_model({"a": 2}, {"a": [3, 4]})
    assert out["req_ids"] == ["a"] and out["logits"].shape == (1, 512)
    assert out["batch_descriptor"] == {"num_tokens": 2, "num_reqs": None, "uniform": False,
                                       "has_lora": False, "num_active_loras": 0}
    assert bridge_runner.shutdown_runner() is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_runner_gives_the_cpu_tokens(weights: str) -> None:
    cuda = _run(_runner(weights, device="cuda"))
    cpu = _run(_runner(weights, device="cpu"))
    for a, b in zip(cuda, cpu):
        assert a.logits.device.type == "cpu"
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-3, atol=1e-3)
