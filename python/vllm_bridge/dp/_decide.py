"""Pure helpers of DP coordination: argument checks, the all_reduce matrix, the decision.

Part of :mod:`vllm_bridge.dp` (which owns the process group), kept apart so that the
decision rules can be read, and tested, on their own.
"""

import numpy as np
import torch

from vllm_bridge._checks import check_int
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.ubatch import is_last_ubatch_empty

# Rows of the all_reduce matrix; column r is written by DP rank r, every other entry is 0,
# so the sum gathers every rank's values in one collective.
ROW_UNPADDED, ROW_PADDED, ROW_UBATCH_VOTE, ROW_CG_MODE, ROW_PAD_VOTE = range(5)
NUM_ROWS = 5


def cudagraph_mode_value(cudagraph_mode: int | CUDAGraphMode) -> int:
    """The int (0, 1, 2) of a runtime cudagraph mode given as an int or a plain member."""
    if isinstance(cudagraph_mode, CUDAGraphMode):
        if not cudagraph_mode.valid_runtime_modes():
            raise ValueError(
                f"cudagraph_mode must be NONE, PIECEWISE or FULL, got {cudagraph_mode.name}"
            )
        return cudagraph_mode.value
    check_int("cudagraph_mode", cudagraph_mode)
    if cudagraph_mode not in (0, 1, 2):
        raise ValueError(
            f"cudagraph_mode must be 0 (NONE), 1 (PIECEWISE) or 2 (FULL), got {cudagraph_mode}"
        )
    return cudagraph_mode


def check_per_request(
    counts: list[int] | np.ndarray | torch.Tensor | None, num_tokens_unpadded: int
) -> None:
    """Check per-request token counts: non-negative ints summing to ``num_tokens_unpadded``."""
    if counts is None:
        return
    if isinstance(counts, (torch.Tensor, np.ndarray)):
        counts = counts.tolist()
    if not isinstance(counts, (list, tuple)):
        raise TypeError(
            f"num_scheduled_tokens_per_request must be a list of ints, got {counts!r}"
        )
    for value in counts:
        check_int("num_scheduled_tokens_per_request entry", value, minimum=0)
    if sum(counts) != num_tokens_unpadded:
        raise ValueError(
            f"num_scheduled_tokens_per_request sums to {sum(counts)}, "
            f"but num_tokens_unpadded is {num_tokens_unpadded}"
        )


def decide(table: torch.Tensor, num_ubatches: int) -> tuple[bool, torch.Tensor, int]:
    """Turn the gathered matrix into the agreed (should_ubatch, counts, cudagraph mode).

    Every rank runs this on the same summed matrix, so every rank decides the same way
    (and raises the same error when the ranks disagree on padding).
    """
    pad_votes = table[ROW_PAD_VOTE].tolist()
    if len(set(pad_votes)) != 1:
        raise ValueError(
            "DP ranks disagree on allow_dp_padding "
            f"(per rank: {[bool(v) for v in pad_votes]}); every rank must pass the same value"
        )
    should_pad = bool(pad_votes[0])
    should_ubatch = bool(torch.all(table[ROW_UBATCH_VOTE] == 1))
    if should_ubatch:
        smallest_real = int(table[ROW_UNPADDED].min())
        largest_padded = int(table[ROW_PADDED].max())
        # A rank with few real tokens would get a last micro-batch of padding only.
        if is_last_ubatch_empty(smallest_real, largest_padded, num_ubatches):
            should_ubatch = False
    if should_ubatch:
        should_pad = True  # micro-batched ranks must all run the same token count
    counts = table[ROW_PADDED].clone()
    if should_pad:
        counts.fill_(int(counts.max()))
    return should_ubatch, counts, int(table[ROW_CG_MODE].min())
