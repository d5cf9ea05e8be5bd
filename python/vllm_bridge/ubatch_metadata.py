"""What each micro-batch of a micro-batched forward pass runs with: its own forward context
(its entry of the attention metadata and slot mapping, DP counts of its own size) and its
slice of the model's inputs, kept together in :class:`UbatchMetadata`.

Apart from :class:`~vllm_bridge.ubatch_wrapper.UBatchWrapper` because two runs build
the same per-micro-batch contexts: the wrapper's threads, and the sequential reference
they are compared with (:mod:`vllm_bridge.demo.sequential_ubatches`). None of it starts a
thread or touches a device: the wrapper assembles these pieces with a run's threads and
barrier (``UBatchWrapper._make_ubatch_metadata``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_bridge.config import VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import DPMetadata, ForwardContext, create_forward_context
from vllm_bridge.ubatching import UBatchContext

__all__ = ["UbatchMetadata", "make_ubatch_forward_contexts", "slice_model_inputs"]


@dataclass
class UbatchMetadata:
    """One micro-batch: its context and its slice of the inputs."""

    context: UBatchContext
    input_ids: torch.Tensor
    positions: torch.Tensor
    inputs_embeds: torch.Tensor | None
    intermediate_tensors: Any | None
    num_tokens: int


def _ubatch_dp_metadata(
    vllm_config: VllmConfig, meta: DPMetadata | None, num_tokens: int
) -> DPMetadata | None:
    """The micro-batch's DP counts: every rank splits at the same point, so each rank's
    micro-batch ``i`` has ``num_tokens`` tokens (checked against the config)."""
    if meta is None:
        return None
    counts = torch.full_like(meta.num_tokens_across_dp_cpu, num_tokens)
    return DPMetadata.make(vllm_config.parallel_config, num_tokens, counts)


def make_ubatch_forward_contexts(
    vllm_config: VllmConfig,
    ubatch_slices: list,
    attn_metadata: Any,
    slot_mapping: Any,
    dp_metadata: DPMetadata | None,
    batch_descriptor: Any,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
) -> list[ForwardContext]:
    """One forward context per micro-batch (the overlapped run's threads and the sequential
    reference both use these): its entry of ``attn_metadata`` and ``slot_mapping`` (lists
    with one entry per micro-batch, or ``None``) and DP counts of its own size.

    Raises:
        ValueError: ``attn_metadata`` or ``slot_mapping`` is not one entry per micro-batch.
    """
    for name, value in (("attn_metadata", attn_metadata), ("slot_mapping", slot_mapping)):
        if value and not (isinstance(value, list) and len(value) == len(ubatch_slices)):
            raise ValueError(
                f"{name} of a micro-batched pass must be a list of {len(ubatch_slices)} "
                f"entries (one per micro-batch), got {type(value).__name__}"
            )
    return [
        create_forward_context(
            attn_metadata[i] if attn_metadata else None,
            vllm_config,
            dp_metadata=_ubatch_dp_metadata(vllm_config, dp_metadata, s.num_tokens),
            batch_descriptor=batch_descriptor,
            cudagraph_runtime_mode=cudagraph_runtime_mode,
            slot_mapping=slot_mapping[i] if slot_mapping else None,
        )
        for i, s in enumerate(ubatch_slices)
    ]


def slice_model_inputs(
    tokens_slice: slice,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    inputs_embeds: torch.Tensor | None,
    intermediate_tensors: Any | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Any | None]:
    """The micro-batch's share of the model's inputs: the tokens of ``tokens_slice``."""
    # M-RoPE positions carry an extra leading dimension: slice the token axis.
    if positions.ndim == 2:
        sliced_positions = positions[:, tokens_slice]
    else:
        sliced_positions = positions[tokens_slice]
    return (
        input_ids[tokens_slice],
        sliced_positions,
        inputs_embeds[tokens_slice] if inputs_embeds is not None else None,
        intermediate_tensors[tokens_slice] if intermediate_tensors is not None else None,
    )
