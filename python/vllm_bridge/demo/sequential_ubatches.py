"""Micro-batches run one after the other on the calling thread: the reference the
overlapped run (:class:`~vllm_bridge.ubatch_wrapper.UBatchWrapper`) is compared with
(``ModelRunner(ubatch_overlap=False)``, the tests, ``bench/ubatch_bench.py``)."""

from collections.abc import Callable

import torch

from vllm_bridge.config import VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import (
    DPMetadata,
    create_forward_context,
    get_forward_context,
    override_forward_context,
)

__all__ = ["run_ubatches_sequentially"]


def run_ubatches_sequentially(
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    vllm_config: VllmConfig,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Run each micro-batch of the current forward context under its own forward context,
    one after the other; the outputs concatenated in order.

    Each micro-batch sees what it would on its own thread: its entry of the outer
    context's ``attn_metadata`` and ``slot_mapping`` lists and DP counts of its own size.
    The first writes its tokens' keys and values to the cache before the second attends
    to them. Every rank splits at the same point (the ranks agreed on one padded size),
    so the MoE collectives stay in lockstep.
    """
    outer = get_forward_context()
    parallel = vllm_config.parallel_config
    outputs = []
    for i, ubatch in enumerate(outer.ubatch_slices or []):
        a, b = ubatch.token_slice.start, ubatch.token_slice.stop
        dp_meta = None
        if parallel.data_parallel_size > 1:
            counts = torch.full((parallel.data_parallel_size,), b - a, dtype=torch.int32)
            dp_meta = DPMetadata.make(parallel, b - a, counts)
        context = create_forward_context(
            outer.attn_metadata[i],
            vllm_config,
            dp_metadata=dp_meta,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            batch_descriptor=outer.batch_descriptor,
            slot_mapping=outer.slot_mapping[i],
        )
        with override_forward_context(context):
            outputs.append(model(input_ids[a:b], positions[a:b]))
    return torch.cat(outputs)
