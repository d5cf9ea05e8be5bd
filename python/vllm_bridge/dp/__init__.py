"""Data-parallel (DP) coordination: the DP process group and the per-step batch agreement.

Each DP rank is one process (for the bridge: one worker). Before the ranks can agree on a
batch they join one ``torch.distributed`` group::

    init_dp_group(rank=0, world_size=2, master_addr="127.0.0.1", master_port=29555)
    ... coordinate_batch_across_dp(...) once per step, on every rank ...
    destroy_dp_group()

Rank 0 hosts the rendezvous store at ``master_addr:master_port``. Arguments left as ``None``
come from the environment (the operator's; a call may name only a loopback rendezvous or
the configured one: :func:`init_dp_group`):

=========================== ===========================================================
``VLLM_DP_RANK``            this process's DP rank
``VLLM_DP_SIZE``            number of DP ranks
``VLLM_DP_MASTER_IP``       rendezvous address (default ``127.0.0.1``)
``VLLM_DP_MASTER_PORT``     rendezvous port (required)
``VLLM_DP_BACKEND``         ``gloo``, ``nccl`` or ``cpu:gloo,cuda:nccl`` (default: the
                            last when CUDA is available, else ``gloo``)
``VLLM_DP_TIMEOUT_S``       seconds to wait for peers at init and at each all_reduce
                            (default 60)
=========================== ===========================================================

Besides the per-step agreement, model layers use the group's collectives
(:func:`dp_all_reduce`, :func:`dp_all_gather`; e.g. the MoE layer of
:mod:`vllm_bridge.demo.model`). A rank whose peers do not arrive within the timeout, at init or
at a collective, gets a :class:`DPTimeoutError`; after a failed collective the group is
unusable until it is torn down and joined again.
"""

import datetime
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from vllm_bridge._ubatch_current import current_ubatch_context
from vllm_bridge.config import ParallelConfig
from vllm_bridge.dp._decide import check_arguments, decide, rank_table
from vllm_bridge.dp._devices import for_the_group, group_device, sync_device
from vllm_bridge.dp._group import begin_run, usable_state, wait_collective
from vllm_bridge.dp._rendezvous import rendezvous
from vllm_bridge.dp._settings import DEFAULT_TIMEOUT_S, resolve_settings
from vllm_bridge.dp._ubatch_sync import UBatchRunSync, describe
from vllm_bridge.ubatch import check_ubatch_thresholds

__all__ = [
    "DPGroupError",
    "DPGroupInfo",
    "DPTimeoutError",
    "DEFAULT_TIMEOUT_S",
    "coordinate_batch_across_dp",
    "destroy_dp_group",
    "dp_all_gather",
    "dp_all_reduce",
    "dp_group_info",
    "init_dp_group",
]
# begin_ubatch_run / UBatchRunSync are for vllm_bridge.ubatch_wrapper only: left out of
# __all__, so they are not part of the generated Elixir bindings.



class DPGroupError(RuntimeError):
    """The DP group is missing, mismatched, already set up differently, or broken."""


class DPTimeoutError(DPGroupError):
    """A DP peer did not arrive in time (at init or at an all_reduce)."""


@dataclass(frozen=True)
class DPGroupInfo:
    """The DP group this process has joined.

    Attributes:
        rank: This process's DP rank.
        world_size: Number of DP ranks.
        master_addr: Rendezvous address (rank 0 hosts the store).
        master_port: Rendezvous port.
        backend: The torch.distributed backend string.
        timeout_s: Seconds to wait for peers at init and at each all_reduce.
        device: Where the group's NCCL collectives run: ``"cuda:<rank mod GPUs>"``, made
            this process's current CUDA device when it joined; ``"cpu"`` for a group
            without NCCL.
    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    backend: str
    timeout_s: float
    device: str = "cpu"


@dataclass
class _State:
    info: DPGroupInfo
    store: dist.Store | None  # None once the group is destroyed
    broken: str | None = None
    ubatch_runs: int = 0  # micro-batched runs begun (the same count on every rank)
    ubatch_last_failed: bool = False  # the last micro-batched run ended with a failure


_lock = threading.Lock()  # guards _state and serialises collectives within this process
_state: _State | None = None


def init_dp_group(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    backend: str | None = None,
    timeout_s: float | None = None,
) -> DPGroupInfo:
    """Join the DP group as ``rank`` of ``world_size``; blocks until every rank has joined.

    Every rank calls this with the same ``world_size``, ``master_addr`` and
    ``master_port``; rank 0 hosts the rendezvous store. Arguments left as ``None`` come from
    ``VLLM_DP_RANK``, ``VLLM_DP_SIZE``, ``VLLM_DP_MASTER_IP`` (default ``127.0.0.1``),
    ``VLLM_DP_MASTER_PORT``, ``VLLM_DP_BACKEND`` and ``VLLM_DP_TIMEOUT_S`` (default 60).
    Calling it again with the same settings returns the current group.

    Where the rendezvous is, is the environment's to say (the operator's: a pool's ``dp:``
    option sets it), not the caller's: an explicit ``master_addr`` must be a loopback
    address written canonically (``127.0.0.1`` or another ``127.x.y.z``, ``::1``) or
    ``localhost``, or exactly the configured ``VLLM_DP_MASTER_IP``; and when it names the
    configured host (not loopback) and ``VLLM_DP_MASTER_PORT`` is set, an explicit
    ``master_port`` must be that port. Anything else (another host or IP, a host name,
    ``127.1``, ``0x7f000001``, ``::ffff:127.0.0.1``, an address with a port, a scope or
    spaces) is refused with ``ValueError`` before any name is resolved or socket opened.

    Returns:
        The joined group's :class:`DPGroupInfo`.

    Raises:
        ValueError / TypeError: a missing or bad setting (the message names it), or a
            ``master_addr`` / ``master_port`` a call may not choose (above).
        DPTimeoutError: the peers did not all join within ``timeout_s`` seconds.
        DPGroupError: this process is already in a different group.
    """
    global _state
    rank, world_size, master_addr, master_port, backend, timeout_s = resolve_settings(
        rank, world_size, master_addr, master_port, backend, timeout_s
    )
    info = DPGroupInfo(
        rank,
        world_size,
        master_addr,
        master_port,
        backend,
        timeout_s,
        device=group_device(rank, backend),
    )

    with _lock:
        if _state is not None:
            if _state.info == info and _state.broken is None:
                return info
            raise DPGroupError(
                f"this process is already in DP group {_state.info}; "
                "call destroy_dp_group() before joining another"
            )
        if dist.is_initialized():
            raise DPGroupError(
                "torch.distributed's default group was initialised outside vllm_bridge.dp; "
                "cannot set up the DP group in this process"
            )
        if info.device != "cpu":
            # NCCL needs one device per rank; ranks on one host take turns over the GPUs.
            torch.cuda.set_device(torch.device(info.device))
        _state = _State(info=info, store=rendezvous(info, DPTimeoutError, DPGroupError))
    return info


def destroy_dp_group() -> bool:
    """Leave the DP group; returns True if one was torn down. Safe to call at any time."""
    global _state
    with _lock:
        if _state is None:
            return False
        # Drop the store through the state too: an exception of a failed collective (which
        # a worker's session keeps for a while) holds the state in its traceback's frames,
        # and rank 0's store would go on listening on master_port, so joining again in this
        # process would fail with EADDRINUSE (or a restarted peer would meet the old store).
        _state.store = None
        _state.broken = _state.broken or "the group was destroyed"
        _state = None
        if dist.is_initialized():
            dist.destroy_process_group()
        return True


def dp_group_info() -> DPGroupInfo | None:
    """The DP group this process has joined, or ``None`` when it has joined none."""
    state = _state
    return state.info if state is not None else None


def _collective(
    what: str,
    expected_size: int,
    expected_rank: int,
    start: Callable[[], Any],
    tensor: torch.Tensor,
) -> None:
    """Run one collective (``start()`` returns its async work on ``tensor``, this rank's
    input) with the group's checks.

    Holds the process lock (collectives of one process never interleave), checks the group
    against the caller's config, waits at most the group's timeout, and marks the group
    broken when a peer does not take part.

    Inside a micro-batch thread (:mod:`vllm_bridge.ubatching`) the collective is a
    hand-over point: it is launched under the lock (so the issue order stays the threads'
    deterministic turn order), then the thread hands its turn to the other micro-batch and
    waits on the work only when the turn comes back, outside the lock.
    """
    ubatch = current_ubatch_context()
    with _lock:
        state = usable_state(_state, expected_size, expected_rank, DPGroupError)
        info = state.info
        if ubatch is None:
            timeout = datetime.timedelta(seconds=info.timeout_s)
            wait_collective(state, what, lambda: start().wait(timeout=timeout), DPTimeoutError)
            return
        # The work only in a holder emptied on the way out: the error of a failed wait
        # keeps this frame (a worker's session keeps recent errors), and a work keeps its
        # process group, and that group rank 0's store, listening on master_port.
        held = [ubatch.launch(what, start, describe(what, tensor))]
    try:
        ubatch.handover(what)
        wait_collective(
            state, what, lambda: ubatch.wait(what, held[0], info.timeout_s), DPTimeoutError
        )
    finally:
        held.clear()


def begin_ubatch_run() -> UBatchRunSync | None:
    """Number a micro-batched run (every rank begins the same runs in the same order) and
    return its link to the other ranks; ``None`` when this process has joined no DP group."""
    with _lock:
        return begin_run(_state, _lock)


def dp_all_reduce(tensor: torch.Tensor, expected_size: int, expected_rank: int) -> torch.Tensor:
    """Sum ``tensor`` in place over the DP group and return it; waits at most the timeout.

    ``expected_size`` / ``expected_rank`` are the caller's config, checked against the
    joined group so a misconfigured rank fails clearly instead of deadlocking. A CUDA
    tensor travels over NCCL when the group has it, otherwise through the CPU (and the
    sum is copied back into it).

    Raises:
        DPGroupError: no group joined, the group does not match, or it broke earlier.
        DPTimeoutError: a peer did not take part within the group's timeout.
    """
    wire = for_the_group(tensor, dp_group_info())
    _collective(
        "all_reduce",
        expected_size,
        expected_rank,
        lambda: dist.all_reduce(wire, async_op=True),
        wire,
    )
    if wire is not tensor:
        tensor.copy_(wire)
    return tensor


def dp_all_gather(tensor: torch.Tensor, expected_size: int, expected_rank: int) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape and dtype on every rank), stacked by rank:
    a new tensor of shape ``(world_size, *tensor.shape)`` on ``tensor``'s device.

    A CUDA tensor travels over NCCL when the group has it, otherwise through the CPU.
    Checks and timeout as :func:`dp_all_reduce`.
    """
    device = tensor.device
    tensor = for_the_group(tensor, dp_group_info()).contiguous()
    parts = [torch.empty_like(tensor) for _ in range(expected_size)]
    _collective(
        "all_gather",
        expected_size,
        expected_rank,
        lambda: dist.all_gather(parts, tensor, async_op=True),
        tensor,
    )
    return torch.stack(parts).to(device)


def coordinate_batch_across_dp(
    num_tokens_unpadded: int,
    allow_microbatching: bool,
    allow_dp_padding: bool,
    parallel_config: ParallelConfig,
    num_tokens_padded: int | None = None,
    uniform_decode: bool | None = None,
    num_scheduled_tokens_per_request: list[int] | np.ndarray | torch.Tensor | None = None,
    cudagraph_mode: int = 0,
) -> tuple[bool, torch.Tensor | None, int]:
    """Coordinates amongst all DP ranks to determine if and how the full batch
    should be split into microbatches.

    Every DP rank calls this once per step (it is one all_reduce over the DP group joined
    with :func:`init_dp_group`, carrying every rank's token counts and votes). All ranks
    get the same answer: micro-batching happens only when every rank votes for it and no
    micro-batch would be empty; token counts are padded to the maximum over ranks when
    padding is allowed (and always when micro-batching); the cudagraph mode is the minimum
    over ranks, so one rank running eagerly makes all run eagerly.

    Args:
        num_tokens_unpadded: Number of tokens without accounting for padding.
        allow_microbatching: If microbatching should be attempted.
        allow_dp_padding: If all DP ranks should be padded up to the same value (every
            rank must pass the same value).
        parallel_config: The parallel config (DP size and rank, micro-batching settings).
        num_tokens_padded: Number of tokens including any non-DP padding (CUDA graphs, TP,
            etc.); defaults to ``num_tokens_unpadded``.
        uniform_decode: Only used if allow_microbatching is True (then required). True if
            the batch only contains single token decodes.
        num_scheduled_tokens_per_request: Only used if allow_microbatching is True. The
            number of tokens per request; checked to sum to ``num_tokens_unpadded``.
        cudagraph_mode: The cudagraph mode for this rank (0=NONE, 1=PIECEWISE, 2=FULL).

    Returns:
        ``(should_ubatch, num_tokens_across_dp, synced_cudagraph_mode)``: whether all ranks
        micro-batch; a CPU int32 tensor of each rank's token count (after padding), or
        ``None`` when DP is off; the cudagraph mode every rank runs with.

    Raises:
        ValueError / TypeError: bad arguments, or ranks that disagree on allow_dp_padding.
        DPGroupError: no DP group, or one that does not match ``parallel_config``.
        DPTimeoutError: a peer did not take part within the group's timeout.
    """
    num_tokens_padded, mode = check_arguments(
        num_tokens_unpadded,
        allow_microbatching,
        allow_dp_padding,
        parallel_config,
        num_tokens_padded,
        uniform_decode,
        num_scheduled_tokens_per_request,
        cudagraph_mode,
    )

    dp_size = parallel_config.data_parallel_size
    dp_rank = parallel_config.data_parallel_rank
    if dp_size == 1:
        return False, None, mode

    vote_ubatch = allow_microbatching and check_ubatch_thresholds(
        parallel_config, num_tokens_unpadded, uniform_decode=bool(uniform_decode)
    )
    info = dp_group_info()
    device = (
        sync_device(info, parallel_config, DPGroupError)
        if info is not None
        else torch.device("cpu")
    )
    table = rank_table(
        dp_size,
        dp_rank,
        num_tokens_unpadded,
        num_tokens_padded,
        vote_ubatch,
        mode,
        allow_dp_padding,
    )
    table = dp_all_reduce(table.to(device), dp_size, dp_rank).cpu()
    return decide(table, parallel_config.num_ubatches)
