"""Micro-batch (ubatch) slices: how one padded batch splits into micro-batches.

A batch's tokens are laid out request after request. A micro-batch takes a contiguous
token range (``token_slice``) and the requests whose tokens overlap it
(``request_slice``); a request that straddles a split point belongs to both sides.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import torch

from vllm_bridge._checks import check_bool, check_int, check_optional_int
from vllm_bridge.config import ParallelConfig

__all__ = [
    "UBatchSlice",
    "UBatchSlices",
    "check_ubatch_thresholds",
    "is_last_ubatch_empty",
    "maybe_create_ubatch_slices",
    "pad_out_ubatch_slices",
]


@dataclass
class UBatchSlice:
    """One micro-batch: its requests and its tokens, both as ``slice(start, stop)``.

    A ``(start, stop)`` pair is accepted for either field and stored as a slice (a caller
    across the bridge has no slice type to send).

    Attributes:
        request_slice: Indices of the requests whose tokens overlap ``token_slice``.
        token_slice: The micro-batch's token positions in the batch.
    """

    request_slice: slice
    token_slice: slice

    def __post_init__(self) -> None:
        for name in ("request_slice", "token_slice"):
            value = getattr(self, name)
            if isinstance(value, (tuple, list)) and len(value) == 2:
                value = slice(value[0], value[1])
                setattr(self, name, value)
            if not isinstance(value, slice):
                raise TypeError(f"UBatchSlice.{name} must be a slice, got {value!r}")
            check_int(f"UBatchSlice.{name}.start", value.start, minimum=0)
            check_int(f"UBatchSlice.{name}.stop", value.stop, minimum=value.start)
            if value.step not in (None, 1):
                raise ValueError(f"UBatchSlice.{name} must have step 1, got {value!r}")

    def is_empty(self) -> bool:
        """True when the micro-batch has no requests or no tokens."""
        return (
            self.request_slice.start == self.request_slice.stop
            or self.token_slice.start == self.token_slice.stop
        )

    @property
    def num_tokens(self) -> int:
        """Number of tokens in the micro-batch."""
        return self.token_slice.stop - self.token_slice.start

    @property
    def num_reqs(self) -> int:
        """Number of requests (whole or partial) in the micro-batch."""
        return self.request_slice.stop - self.request_slice.start


#: The micro-batches of one batch, in order.
UBatchSlices: TypeAlias = list[UBatchSlice]


def is_last_ubatch_empty(orig_num_tokens: int, padded_num_tokens: int, num_ubatches: int) -> bool:
    """True when splitting ``padded_num_tokens`` evenly leaves the last micro-batch no real token.

    Each of the first ``num_ubatches - 1`` micro-batches takes
    ``padded_num_tokens // num_ubatches`` tokens; if those already cover all
    ``orig_num_tokens`` real tokens, the last micro-batch would hold only padding.
    """
    check_int("orig_num_tokens", orig_num_tokens, minimum=0)
    check_int("padded_num_tokens", padded_num_tokens, minimum=0)
    check_int("num_ubatches", num_ubatches, minimum=1)
    return (padded_num_tokens // num_ubatches) * (num_ubatches - 1) >= orig_num_tokens


def check_ubatch_thresholds(
    config: ParallelConfig, num_tokens: int, uniform_decode: bool
) -> bool:
    """Whether this rank wants to micro-batch a batch of ``num_tokens`` tokens.

    False when micro-batching (``config.enable_dbo``) is off; otherwise compares
    ``num_tokens`` with the decode threshold for uniform-decode batches and with the
    prefill threshold for the rest.
    """
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"config must be a ParallelConfig, got {config!r}")
    check_int("num_tokens", num_tokens, minimum=0)
    check_bool("uniform_decode", uniform_decode)
    if not config.enable_dbo:
        return False
    if uniform_decode:
        return num_tokens >= config.dbo_decode_token_threshold
    return num_tokens >= config.dbo_prefill_token_threshold


def pad_out_ubatch_slices(
    ubatch_slices: UBatchSlices, num_total_tokens: int, num_reqs_padded: int
) -> UBatchSlices:
    """Extend the last micro-batch so the slices cover the padded batch.

    The last slice's token range is stretched to ``num_total_tokens`` and its request range
    to ``num_reqs_padded``; the others are returned unchanged.
    """
    if not ubatch_slices:
        raise ValueError("ubatch_slices must not be empty")
    last = ubatch_slices[-1]
    check_int("num_total_tokens", num_total_tokens, minimum=last.token_slice.stop)
    check_int("num_reqs_padded", num_reqs_padded, minimum=last.request_slice.stop)
    padded_last = UBatchSlice(
        request_slice=slice(last.request_slice.start, num_reqs_padded),
        token_slice=slice(last.token_slice.start, num_total_tokens),
    )
    return [*ubatch_slices[:-1], padded_last]


def _as_int_list(name: str, values: "Sequence[int] | np.ndarray | torch.Tensor") -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    elif isinstance(values, np.ndarray):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of ints, got {values!r}")
    for value in values:
        check_int(f"{name} entry", value, minimum=0)
    return list(values)


def maybe_create_ubatch_slices(
    should_ubatch: bool,
    num_scheduled_tokens: list[int] | np.ndarray | torch.Tensor,
    num_tokens_padded: int,
    num_reqs_padded: int,
    num_ubatches: int = 2,
    split_point: int | None = None,
) -> tuple[UBatchSlices | None, UBatchSlices | None]:
    """Split a batch into micro-batches, unpadded and padded.

    Args:
        should_ubatch: The DP ranks' agreed decision; when False nothing is split.
        num_scheduled_tokens: Tokens scheduled for each request, in batch order.
        num_tokens_padded: The batch's token count after padding (every micro-batch
            together covers exactly this many tokens once padded).
        num_reqs_padded: The request count after padding.
        num_ubatches: Number of micro-batches.
        split_point: Tokens per micro-batch before the last one; defaults to
            ``num_tokens_padded // num_ubatches``.

    Returns:
        ``(None, None)`` when ``should_ubatch`` is False; otherwise ``(slices, padded)``
        where ``slices`` end at the last real token and ``padded`` stretch the last
        micro-batch to ``num_tokens_padded`` tokens and ``num_reqs_padded`` requests.
    """
    check_bool("should_ubatch", should_ubatch)
    if not should_ubatch:
        return None, None
    counts = _as_int_list("num_scheduled_tokens", num_scheduled_tokens)
    check_int("num_ubatches", num_ubatches, minimum=2)
    total = sum(counts)
    check_int("num_tokens_padded", num_tokens_padded, minimum=total)
    check_int("num_reqs_padded", num_reqs_padded, minimum=len(counts))
    check_optional_int("split_point", split_point, minimum=1)
    if split_point is None:
        split_point = num_tokens_padded // num_ubatches
    boundaries = [split_point * i for i in range(1, num_ubatches)]
    if boundaries[-1] >= total:
        raise ValueError(
            f"split_point {split_point} x {num_ubatches - 1} reaches the batch's "
            f"{total} real tokens; a micro-batch would be empty"
        )
    cu_tokens = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
    slices: UBatchSlices = []
    start = 0
    for stop in [*boundaries, total]:
        # First request holding token `start`; first request starting at or after `stop`.
        req_start = int(np.searchsorted(cu_tokens, start, side="right") - 1)
        req_stop = int(np.searchsorted(cu_tokens, stop, side="left"))
        slices.append(UBatchSlice(slice(req_start, req_stop), slice(start, stop)))
        start = stop
    padded = pad_out_ubatch_slices(slices, num_tokens_padded, num_reqs_padded)
    return slices, padded
