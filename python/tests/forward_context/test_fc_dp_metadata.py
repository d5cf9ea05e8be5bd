"""DPMetadata and the per-rank size helpers (sequence-parallel split, chunking)."""

import pytest
import torch

from vllm_bridge.config import ParallelConfig
from vllm_bridge.forward_context import (
    DPMetadata,
    _compute_chunked_local_num_tokens,
    _compute_sp_num_tokens,
)

RANK1_OF_2 = ParallelConfig(data_parallel_size=2, data_parallel_rank=1)


def test_sp_split_ceil_divides_and_repeats() -> None:
    assert _compute_sp_num_tokens(torch.tensor([5, 3]), 2) == [3, 3, 2, 2]
    assert _compute_sp_num_tokens(torch.tensor([5, 3]), 1) == [5, 3]
    assert _compute_sp_num_tokens([7, 0, 1], 3) == [3, 3, 3, 0, 0, 0, 1, 1, 1]


def test_chunks_take_what_is_left_and_never_drop_below_one() -> None:
    counts = torch.tensor([10, 3])
    chunks = [_compute_chunked_local_num_tokens(counts, 1, 4, i) for i in range(4)]
    # Rank 0: 4, 4, 2, then 1 to keep in step; rank 1: 3, then 1s.
    assert chunks == [[4, 3], [4, 1], [2, 1], [1, 1]]


def test_chunks_with_sequence_parallelism() -> None:
    counts = torch.tensor([5, 3])  # per SP rank: [3, 3, 2, 2]
    assert _compute_chunked_local_num_tokens(counts, 2, 2, 0) == [2, 2, 2, 2]
    assert _compute_chunked_local_num_tokens(counts, 2, 2, 1) == [1, 1, 1, 1]


@pytest.mark.parametrize(
    "args, exc, needle",
    [
        (([5, 3], 0), ValueError, "sequence_parallel_size must be >= 1, got 0"),
        ((torch.tensor([[5, 3]]), 1), ValueError, "1-D integer tensor"),
        ((torch.tensor([5.0, 3.0]), 1), ValueError, "torch.float32"),
        (([5, -3], 1), ValueError, "entry must be >= 0, got -3"),
        (("5,3", 1), TypeError, "must be a tensor or a list of ints"),
    ],
)
def test_sp_split_refuses_bad_input(args: tuple, exc: type, needle: str) -> None:
    with pytest.raises(exc, match=needle):
        _compute_sp_num_tokens(*args)


def test_chunking_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="max_num_tokens must be >= 1, got 0"):
        _compute_chunked_local_num_tokens([4], 1, 0, 0)
    with pytest.raises(ValueError, match="chunk_idx must be >= 0, got -1"):
        _compute_chunked_local_num_tokens([4], 1, 2, -1)


def test_make_keeps_counts_and_their_maximum() -> None:
    meta = DPMetadata.make(RANK1_OF_2, 3, torch.tensor([5, 3]))
    assert meta.num_tokens_across_dp_cpu.tolist() == [5, 3]
    assert int(meta.max_tokens_across_dp_cpu) == 5
    assert meta.local_sizes is None
    from_list = DPMetadata.make(RANK1_OF_2, 3, [5, 3])  # type: ignore[arg-type]
    assert from_list.num_tokens_across_dp_cpu.dtype == torch.int32


@pytest.mark.parametrize(
    "config, num_tokens, counts, needle",
    [
        (RANK1_OF_2, 4, torch.tensor([5, 3]), r"num_tokens_across_dp_cpu\[1\] is 3 .* is 4"),
        (RANK1_OF_2, 3, torch.tensor([5, 3, 1]), "has 3 entries"),
        (RANK1_OF_2, 3, None, "num_tokens_across_dp_cpu is required"),
        (ParallelConfig(), 3, torch.tensor([3]), "data_parallel_size > 1, got 1"),
        (
            ParallelConfig(data_parallel_size=2, is_moe_model=False),
            3,
            torch.tensor([3, 3]),
            "is_moe_model is False",
        ),
    ],
)
def test_make_refuses_inconsistent_input(
    config: ParallelConfig, num_tokens: int, counts: torch.Tensor | None, needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        DPMetadata.make(config, num_tokens, counts)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((torch.tensor(5), [5, 3]), "num_tokens_across_dp_cpu must be a 1-D integer tensor"),
        ((torch.tensor(5), torch.tensor([5.0, 3.0])), "1-D integer tensor"),
        ((torch.tensor(5), torch.tensor([[5, 3]])), "1-D integer tensor"),
        ((5, torch.tensor([5, 3])), "max_tokens_across_dp_cpu must be a one-element tensor"),
        ((torch.tensor([5, 3]), torch.tensor([5, 3])), "one-element tensor"),
        ((torch.tensor(5), torch.tensor([5, 3]), [1, "2"]), "local_sizes must be a list of int"),
    ],
)
def test_built_directly_it_still_checks_its_fields(args: tuple, needle: str) -> None:
    with pytest.raises(TypeError, match=needle):
        DPMetadata(*args)


def test_chunked_sizes_set_local_sizes_only_inside() -> None:
    meta = DPMetadata.make(RANK1_OF_2, 3, torch.tensor([10, 3]))
    with meta.chunked_sizes(1, 4, 1) as sizes:
        assert sizes == [4, 1]
        assert meta.get_chunk_sizes_across_dp_rank() == [4, 1]
    assert meta.local_sizes is None
    with pytest.raises(RuntimeError, match="only set inside"):
        meta.get_chunk_sizes_across_dp_rank()


def test_sizes_are_reset_when_the_body_raises() -> None:
    meta = DPMetadata.make(RANK1_OF_2, 3, torch.tensor([5, 3]))
    with pytest.raises(KeyError):
        with meta.sp_local_sizes(2) as sizes:
            assert sizes == [3, 3, 2, 2]
            raise KeyError("boom")
    assert meta.local_sizes is None
    with pytest.raises(KeyError):
        with meta.chunked_sizes(2, 2, 0):
            raise KeyError("boom")
    assert meta.local_sizes is None


def test_cumulative_tokens_across_sp() -> None:
    meta = DPMetadata.make(RANK1_OF_2, 3, torch.tensor([5, 3]))
    assert meta.cu_tokens_across_sp(1).tolist() == [5, 8]
    assert meta.cu_tokens_across_sp(2).tolist() == [3, 6, 8, 10]
