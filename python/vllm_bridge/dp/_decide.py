"""Pure helpers of DP coordination: argument checks, the all_reduce matrix, the decision.

Part of :mod:`vllm_bridge.dp` (which owns the process group), kept apart so that the
decision rules can be read, and tested, on their own.
"""

import numpy as np
import torch

from vllm_bridge._checks import check_bool, check_int, check_optional_bool, check_optional_int
from vllm_bridge.config import ParallelConfig
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


def check_arguments(
    num_tokens_unpadded: int,
    allow_microbatching: bool,
    allow_dp_padding: bool,
    parallel_config: ParallelConfig,
    num_tokens_padded: int | None,
    uniform_decode: bool | None,
    num_scheduled_tokens_per_request: list[int] | np.ndarray | torch.Tensor | None,
    cudagraph_mode: int,
) -> tuple[int, int]:
    """Check the arguments of :func:`vllm_bridge.dp.coordinate_batch_across_dp` (raising
    ``ValueError`` / ``TypeError`` naming the bad one); return ``num_tokens_padded`` (its
    default filled in) and the cudagraph mode as an int."""
    check_int("num_tokens_unpadded", num_tokens_unpadded, minimum=0)
    check_bool("allow_microbatching", allow_microbatching)
    check_bool("allow_dp_padding", allow_dp_padding)
    if not isinstance(parallel_config, ParallelConfig):
        raise TypeError(f"parallel_config must be a ParallelConfig, got {parallel_config!r}")
    check_optional_int("num_tokens_padded", num_tokens_padded, minimum=num_tokens_unpadded)
    check_optional_bool("uniform_decode", uniform_decode)
    check_per_request(num_scheduled_tokens_per_request, num_tokens_unpadded)
    mode = cudagraph_mode_value(cudagraph_mode)
    if allow_microbatching and uniform_decode is None:
        raise ValueError("uniform_decode must be given (True/False) when allow_microbatching")
    if num_tokens_padded is None:
        num_tokens_padded = num_tokens_unpadded
    if num_tokens_padded >= 2**31:
        raise ValueError(f"num_tokens_padded must fit in int32, got {num_tokens_padded}")
    return num_tokens_padded, mode


def rank_table(
    dp_size: int,
    dp_rank: int,
    num_tokens_unpadded: int,
    num_tokens_padded: int,
    vote_ubatch: bool,
    mode: int,
    allow_dp_padding: bool,
) -> torch.Tensor:
    """This rank's all_reduce matrix (CPU, int32): its column holds its values, every
    other entry is 0."""
    table = torch.zeros(NUM_ROWS, dp_size, dtype=torch.int32)
    table[ROW_UNPADDED, dp_rank] = num_tokens_unpadded
    table[ROW_PADDED, dp_rank] = num_tokens_padded
    table[ROW_UBATCH_VOTE, dp_rank] = int(vote_ubatch)
    table[ROW_CG_MODE, dp_rank] = mode
    table[ROW_PAD_VOTE, dp_rank] = int(allow_dp_padding)
    return table


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
