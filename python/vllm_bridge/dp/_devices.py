"""Which device each of the DP group's collectives runs on: the rank's GPU for a group
with NCCL, the CPU otherwise (and for the step's agreement when the config asks for it).

Part of :mod:`vllm_bridge.dp`, which holds the group's state and the errors and imports
this module; kept apart because these rules are read (and tested) without a group. This
module never imports that one (no import circle): the group's
:class:`~vllm_bridge.dp.DPGroupInfo` and the error class to raise are passed in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_bridge.platforms import rank_device

if TYPE_CHECKING:
    from vllm_bridge.config import ParallelConfig
    from vllm_bridge.dp import DPGroupInfo


def group_device(rank: int, backend: str) -> str:
    """The device a rank's NCCL collectives use (``cpu`` for a group without NCCL)."""
    if "nccl" not in backend:
        return "cpu"
    return rank_device(rank)


def sync_device(
    info: DPGroupInfo, parallel_config: ParallelConfig, group_error: type[Exception]
) -> torch.device:
    """Where the DP all_reduce runs: CUDA (NCCL) unless the config asks for the CPU group;
    raises ``group_error`` when it asks for a CPU group the DP group does not have."""
    if "nccl" not in info.backend:
        return torch.device("cpu")
    if parallel_config.disable_nccl_for_dp_synchronization:
        if "gloo" not in info.backend:
            raise group_error(
                "disable_nccl_for_dp_synchronization needs a gloo backend, but the DP group "
                f"was set up with {info.backend!r}"
            )
        return torch.device("cpu")
    return torch.device(info.device)


def for_the_group(tensor: torch.Tensor, info: DPGroupInfo | None) -> torch.Tensor:
    """``tensor`` as the joined group's backend (``info``: the group, or ``None``) takes
    it: a CUDA tensor goes through the CPU unless the group has NCCL (the rule of both
    collectives of :mod:`vllm_bridge.dp`)."""
    if tensor.device.type == "cuda" and (info is None or "nccl" not in info.backend):
        return tensor.cpu()
    return tensor
