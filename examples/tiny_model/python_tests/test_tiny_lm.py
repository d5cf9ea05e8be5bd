"""Unit tests of the example's model, in one process (the ExUnit suite runs it in workers)."""

import pytest
import torch

import tiny_lm
from vllm_bridge.config import ParallelConfig, VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import BatchDescriptor, set_forward_context


@pytest.fixture(autouse=True)
def model() -> tiny_lm.ModelInfo:
    return tiny_lm.setup(seed=3)


def run(tokens: list[int], **context: object) -> tiny_lm.ForwardOutput:
    config = context.pop("vllm_config", VllmConfig())
    with set_forward_context(context.pop("attn_metadata", None), config, **context):
        return tiny_lm.forward(tokens)


def test_setup_is_deterministic_per_seed() -> None:
    first = tiny_lm.model_info()
    again = tiny_lm.setup(seed=3)
    other = tiny_lm.setup(seed=4)
    assert again.checksum == first.checksum
    assert other.checksum != first.checksum
    assert again.setup_calls == first.setup_calls + 1


def test_forward_needs_a_context() -> None:
    with pytest.raises(RuntimeError, match="forward context"):
        tiny_lm.forward([1, 2])


def test_forward_reads_the_context() -> None:
    out = run([1, 2, 3], num_tokens=3, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
              batch_descriptor=BatchDescriptor(num_tokens=8),
              attn_metadata={"layers.1": {"scale": 0.5}})
    assert out.logits.shape == (3, 64)
    assert out.context == tiny_lm.ContextSeen(
        num_tokens=3, padded_tokens=8, num_tokens_across_dp=None, batch_descriptor_tokens=8,
        cudagraph_mode="PIECEWISE", virtual_engine=0, scaled_layers=["layers.1"])
    # The scale changes the result; padding does not.
    assert not torch.allclose(out.logits, run([1, 2, 3]).logits)
    assert torch.allclose(run([1, 2, 3], attn_metadata={"layers.1": {"scale": 0.5}}).logits,
                          out.logits, atol=1e-6)


def test_dp_metadata_pads_to_the_largest_rank() -> None:
    config = VllmConfig(parallel_config=ParallelConfig(data_parallel_size=2, data_parallel_rank=1))
    out = run([5, 6], vllm_config=config, num_tokens=2, num_tokens_across_dp=[7, 2])
    assert out.context.num_tokens_across_dp == [7, 2]
    assert out.context.padded_tokens == 7
    assert out.next_tokens == run([5, 6]).next_tokens


def test_tokens_are_independent_of_their_batch() -> None:
    both = run([1, 2, 3, 4, 5])
    assert torch.allclose(both.logits[:2], run([1, 2]).logits, atol=1e-6)
    assert torch.allclose(both.logits[2:], run([3, 4, 5]).logits, atol=1e-6)


@pytest.mark.parametrize("bad, message", [
    ([], "non-empty list"), ("abc", "non-empty list"), ([1, 64], r"token_ids\[1\].*64"),
    ([1, -1], r"token_ids\[1\].*-1"), ([True], r"token_ids\[0\]"), ([1.5], r"token_ids\[0\]"),
])
def test_bad_tokens_name_the_value(bad: object, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        run(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs, message", [
    ({"seed": -1}, "seed"), ({"vocab_size": True}, "vocab_size"), ({"num_layers": 0}, "num_layers"),
])
def test_bad_setup_names_the_argument(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        tiny_lm.setup(**kwargs)  # type: ignore[arg-type]


def test_bad_attn_metadata_names_the_value() -> None:
    with pytest.raises(TypeError, match="scale.*'x'"):
        run([1], attn_metadata={"layers.0": {"scale": "x"}})
