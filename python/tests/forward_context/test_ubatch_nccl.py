"""UBatchWrapper over a real NCCL DP group (CUDA only): the collectives launched from each
thread's comm stream, eagerly and under FULL graph capture. A 1-rank NCCL group is legal
on one GPU; the 2-rank NCCL run (one GPU per rank) is in tests/demo/test_ubatch_overlap.py.
"""

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dp_env import free_port
from test_ubatch_wrapper import SLICES, _ubatch_threads
from vllm_bridge import dp
from vllm_bridge.config import ParallelConfig, VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import DPMetadata, create_forward_context, override_forward_context
from vllm_bridge.ubatch_wrapper import UBatchWrapper

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none is available here)"
)


@pytest.fixture
def nccl_group() -> Iterator[None]:
    dp.init_dp_group(0, 1, "127.0.0.1", free_port(), "nccl", 30.0)
    try:
        yield
    finally:
        dp.destroy_dp_group()


class GatherReduce:
    """``layers`` rounds of: compute, all-gather the tokens over the DP group, compute,
    all-reduce (a 1-rank group: the gather stacks one copy, the sum is the tensor)."""

    def __init__(self, layers: int = 2) -> None:
        self.layers = layers

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = input_ids.float() * 2 + positions.float()
        for layer in range(self.layers):
            x = x * 1.5 + layer
            x = dp.dp_all_gather(x, 1, 0)[0] + 1
            x = dp.dp_all_reduce(x * 0.5, 1, 0)
        return x


def _dp_config() -> VllmConfig:
    parallel = ParallelConfig(data_parallel_size=2, data_parallel_rank=0, is_moe_model=True)
    return VllmConfig(parallel_config=parallel)


def _context(mode: CUDAGraphMode) -> Any:
    dp_meta = DPMetadata(torch.tensor(8), torch.tensor([8, 8], dtype=torch.int32))
    return create_forward_context(
        ["meta-0", "meta-1"], _dp_config(), dp_metadata=dp_meta, ubatch_slices=SLICES,
        cudagraph_runtime_mode=mode,
    )


def _inputs(scale: int = 1) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.arange(8, device="cuda") * 3 * scale,
            "positions": torch.arange(8, device="cuda")}


def _expected(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    x = inputs["input_ids"].float() * 2 + inputs["positions"].float()
    for layer in range(2):
        x = ((x * 1.5 + layer) + 1) * 0.5
    return x


def test_eager_micro_batches_over_nccl_match_the_plain_pass(nccl_group: None) -> None:
    wrapper = UBatchWrapper(GatherReduce(), _dp_config(), CUDAGraphMode.NONE, "cuda")
    with override_forward_context(_context(CUDAGraphMode.NONE)):
        out = wrapper(**_inputs())
    torch.testing.assert_close(out, _expected(_inputs()))
    assert wrapper.last_run == "overlapped" and _ubatch_threads() == []


def test_full_capture_over_nccl_replays_new_inputs(nccl_group: None) -> None:
    wrapper = UBatchWrapper(GatherReduce(), _dp_config(), CUDAGraphMode.FULL, "cuda")
    with override_forward_context(_context(CUDAGraphMode.FULL)):
        first = wrapper(**_inputs()).clone()
        assert wrapper.last_run == "captured"
        torch.testing.assert_close(first, _expected(_inputs()))
        second = wrapper(**_inputs(scale=2)).clone()
        assert wrapper.last_run == "replayed"
        torch.testing.assert_close(second, _expected(_inputs(scale=2)))
    assert _ubatch_threads() == []
