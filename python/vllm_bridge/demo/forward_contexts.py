"""What the forward contexts of the demo's model runner carry, for its two kinds of pass:

* a step's (:func:`step_layer_metadata`): the attention metadata and slot mapping of
  each attention layer, the whole batch's, or, when the ranks agreed to micro-batch, one
  such entry per micro-batch with its own tokens only (each micro-batch's forward context
  takes its entry: :func:`~vllm_bridge.ubatch_metadata.make_ubatch_forward_contexts`);
  the runner passes them to ``set_forward_context`` with the step's other facts;
* a warm-up or capture pass's (:func:`capture_context`): every token padding, the same
  padded size on every DP rank.

Apart from :mod:`vllm_bridge.demo.model_runner` because they are pure functions of the
config and the batch (no runner state), and the capture one is handed to the graph
manager (:class:`~vllm_bridge.demo.graphs.GraphManager`), which calls it for each graph.
"""

from contextlib import AbstractContextManager

import torch

from vllm_bridge.config import VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.demo.batch import InputBatch
from vllm_bridge.demo.graphs import ForwardInputs
from vllm_bridge.demo.model.layers import AttentionMetadata
from vllm_bridge.forward_context import (
    BatchDescriptor,
    DPMetadata,
    create_forward_context,
    override_forward_context,
)

__all__ = ["capture_context", "step_layer_metadata"]


def step_layer_metadata(
    vllm_config: VllmConfig, batch: InputBatch, ubatch_slices: list | None
) -> tuple[dict | list, dict | list]:
    """The ``attn_metadata`` and ``slot_mapping`` of a step's forward context: a dict by
    attention layer name, or, micro-batched, a list of one such dict per micro-batch."""
    names = list(vllm_config.compilation_config.static_forward_context)
    attn: dict | list = {name: batch.attn_metadata for name in names}
    slots: dict | list = {name: batch.slot_mapping for name in names}
    if ubatch_slices is not None:
        # One entry per micro-batch: what each micro-batch's forward context carries.
        attn, slots = [], []
        for ubatch in ubatch_slices:
            a, b = ubatch.token_slice.start, ubatch.token_slice.stop
            meta = batch.attn_metadata.slice(a, b)
            attn.append({name: meta for name in names})
            slots.append({name: batch.slot_mapping[a:b] for name in names})
    return attn, slots


def capture_context(
    vllm_config: VllmConfig,
    descriptor: BatchDescriptor,
    mode: CUDAGraphMode,
    inputs: ForwardInputs,
) -> AbstractContextManager:
    """The forward context of a warm-up or capture pass: every token is padding
    (slot -1), and with DP every rank runs the same padded size. Not through
    ``set_forward_context``: these passes are not steps (no batch-size stats)."""
    n = inputs.num_tokens
    names = list(vllm_config.compilation_config.static_forward_context)
    parallel = vllm_config.parallel_config
    dp_meta = None
    if parallel.data_parallel_size > 1:
        counts = torch.full((parallel.data_parallel_size,), n, dtype=torch.int32)
        dp_meta = DPMetadata.make(parallel, n, counts)
    context = create_forward_context(
        {name: AttentionMetadata([0], [], [], 0) for name in names},
        vllm_config,
        dp_metadata=dp_meta,
        cudagraph_runtime_mode=mode,
        batch_descriptor=descriptor,
        slot_mapping={name: inputs.slot_mapping for name in names},
    )
    return override_forward_context(context)
