"""UBatchSlice and slicing a padded batch into micro-batches."""

import numpy as np
import pytest
import torch

from vllm_bridge.config import ParallelConfig
from vllm_bridge.ubatch import (
    UBatchSlice,
    check_ubatch_thresholds,
    is_last_ubatch_empty,
    maybe_create_ubatch_slices,
    pad_out_ubatch_slices,
)


def test_start_stop_pairs_become_slices() -> None:
    s = UBatchSlice((0, 2), [2, 6])  # type: ignore[arg-type]
    assert s == UBatchSlice(slice(0, 2), slice(2, 6))
    with pytest.raises(TypeError, match=r"token_slice must be a slice, got \(1, 2, 3\)"):
        UBatchSlice((0, 2), (1, 2, 3))  # type: ignore[arg-type]


def test_slice_sizes_and_emptiness() -> None:
    s = UBatchSlice(slice(1, 3), slice(5, 10))
    assert (s.num_tokens, s.num_reqs, s.is_empty()) == (5, 2, False)
    assert UBatchSlice(slice(2, 2), slice(5, 10)).is_empty()
    assert UBatchSlice(slice(0, 2), slice(7, 7)).is_empty()


@pytest.mark.parametrize(
    "req, tok, exc, needle",
    [
        ((0, 2), "0:4", TypeError, "token_slice must be a slice"),
        ((3, 1), (0, 4), ValueError, "request_slice.stop must be >= 3, got 1"),
        ((0, None), (0, 4), TypeError, "request_slice.stop must be an int"),
        ((0, 2, 2), (0, 4), ValueError, "step 1"),
    ],
)
def test_slice_validation(req: tuple, tok: object, exc: type, needle: str) -> None:
    token_slice = slice(*tok) if isinstance(tok, tuple) else tok
    with pytest.raises(exc, match=needle):
        UBatchSlice(slice(*req), token_slice)  # type: ignore[arg-type]


def test_two_way_split_puts_a_straddling_request_in_both_halves() -> None:
    # Requests of 3, 5 and 2 tokens (10 real), padded to 12 tokens and 4 requests.
    plain, padded = maybe_create_ubatch_slices(True, [3, 5, 2], 12, 4)
    assert plain == [
        UBatchSlice(slice(0, 2), slice(0, 6)),
        UBatchSlice(slice(1, 3), slice(6, 10)),
    ]
    assert padded == [
        UBatchSlice(slice(0, 2), slice(0, 6)),
        UBatchSlice(slice(1, 4), slice(6, 12)),
    ]
    assert sum(s.num_tokens for s in padded) == 12


def test_split_on_a_request_boundary() -> None:
    plain, _ = maybe_create_ubatch_slices(True, np.array([2, 2, 2, 2]), 8, 4)
    assert plain == [UBatchSlice(slice(0, 2), slice(0, 4)), UBatchSlice(slice(2, 4), slice(4, 8))]


def test_three_way_split_with_explicit_split_point_and_tensor_counts() -> None:
    plain, padded = maybe_create_ubatch_slices(
        True, torch.tensor([4, 4, 4]), 12, 3, num_ubatches=3, split_point=3
    )
    assert [(s.request_slice, s.token_slice) for s in plain] == [
        (slice(0, 1), slice(0, 3)),
        (slice(0, 2), slice(3, 6)),
        (slice(1, 3), slice(6, 12)),
    ]
    assert padded == plain


def test_no_split_when_not_agreed() -> None:
    assert maybe_create_ubatch_slices(False, [3, 5], 8, 2) == (None, None)


def test_split_that_would_leave_an_empty_micro_batch_is_refused() -> None:
    # 4 real tokens padded to 8: the second half would be padding only.
    with pytest.raises(ValueError, match="micro-batch would be empty"):
        maybe_create_ubatch_slices(True, [4], 8, 1)


@pytest.mark.parametrize(
    "args, exc, needle",
    [
        (([3, -1], 8, 2), ValueError, "num_scheduled_tokens entry must be >= 0, got -1"),
        (([3, 5], 7, 2), ValueError, "num_tokens_padded must be >= 8, got 7"),
        (([3, 5], 8, 1), ValueError, "num_reqs_padded must be >= 2, got 1"),
        (("35", 8, 2), TypeError, "num_scheduled_tokens must be a list of ints"),
    ],
)
def test_slicing_refuses_bad_input(args: tuple, exc: type, needle: str) -> None:
    with pytest.raises(exc, match=needle):
        maybe_create_ubatch_slices(True, *args)


def test_pad_out_stretches_only_the_last_slice() -> None:
    slices = [UBatchSlice(slice(0, 1), slice(0, 4)), UBatchSlice(slice(1, 2), slice(4, 6))]
    padded = pad_out_ubatch_slices(slices, 8, 3)
    assert padded[0] is slices[0]
    assert padded[1] == UBatchSlice(slice(1, 3), slice(4, 8))
    with pytest.raises(ValueError, match="num_total_tokens must be >= 6, got 5"):
        pad_out_ubatch_slices(slices, 5, 3)
    with pytest.raises(ValueError, match="must not be empty"):
        pad_out_ubatch_slices([], 5, 3)


@pytest.mark.parametrize(
    "orig, padded, n, empty",
    [(4, 8, 2, True), (5, 8, 2, False), (3, 8, 2, True), (6, 9, 3, True), (7, 9, 3, False)],
)
def test_is_last_ubatch_empty(orig: int, padded: int, n: int, empty: bool) -> None:
    assert is_last_ubatch_empty(orig, padded, n) is empty


def test_thresholds_follow_the_switch_and_the_batch_kind() -> None:
    off = ParallelConfig(enable_dbo=False)
    on = ParallelConfig(
        enable_dbo=True, dbo_decode_token_threshold=4, dbo_prefill_token_threshold=16
    )
    assert check_ubatch_thresholds(off, 10_000, uniform_decode=True) is False
    assert check_ubatch_thresholds(on, 4, uniform_decode=True) is True
    assert check_ubatch_thresholds(on, 3, uniform_decode=True) is False
    assert check_ubatch_thresholds(on, 15, uniform_decode=False) is False
    assert check_ubatch_thresholds(on, 16, uniform_decode=False) is True
    with pytest.raises(TypeError, match="config must be a ParallelConfig"):
        check_ubatch_thresholds(None, 4, True)  # type: ignore[arg-type]
