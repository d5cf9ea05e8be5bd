"""Micro-batches run one after the other on the calling thread: the reference the
overlapped run (:class:`~vllm_bridge.ubatch_wrapper.UBatchWrapper`) is compared with
(``ModelRunner(ubatch_overlap=False)``, the tests, ``bench/ubatch_bench.py``)."""

from collections.abc import Callable

import torch

from vllm_bridge.config import VllmConfig
from vllm_bridge.forward_context import get_forward_context, override_forward_context
from vllm_bridge.ubatch_metadata import make_ubatch_forward_contexts

__all__ = ["run_ubatches_sequentially"]


def run_ubatches_sequentially(
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    vllm_config: VllmConfig,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Run each micro-batch of the current forward context under its own forward context,
    one after the other; the outputs concatenated in order.

    Each micro-batch gets the forward context it would get on its own thread
    (:func:`~vllm_bridge.ubatch_metadata.make_ubatch_forward_contexts`: its entry of the
    outer context's ``attn_metadata`` and ``slot_mapping`` lists, DP counts of its own
    size). The first writes its tokens' keys and values to the cache before the second
    attends to them. Every rank splits at the same point (the ranks agreed on one padded
    size), so the MoE collectives stay in lockstep.
    """
    outer = get_forward_context()
    slices = outer.ubatch_slices or []
    contexts = make_ubatch_forward_contexts(
        vllm_config,
        slices,
        outer.attn_metadata,
        outer.slot_mapping,
        outer.dp_metadata,
        outer.batch_descriptor,
    )
    outputs = []
    for ubatch, context in zip(slices, contexts):
        a, b = ubatch.token_slice.start, ubatch.token_slice.stop
        with override_forward_context(context):
            outputs.append(model(input_ids[a:b], positions[a:b]))
    return torch.cat(outputs)
