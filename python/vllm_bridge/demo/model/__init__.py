"""A small mixture-of-experts transformer whose layers read the forward context.

* :mod:`~vllm_bridge.demo.model.config` - :class:`ModelConfig`, the model's shape;
* :mod:`~vllm_bridge.demo.model.layers` - RMSNorm, a batch-invariant linear map, causal
  attention over a KV cache (reads ``attn_metadata`` and ``slot_mapping``);
* :mod:`~vllm_bridge.demo.model.moe` - the MoE layer, chunked over DP ranks in lockstep (reads
  ``dp_metadata``);
* :mod:`~vllm_bridge.demo.model.transformer` - :class:`MoETransformer`;
* :mod:`~vllm_bridge.demo.model.weights` - weights from a seed, saved and loaded with checks.

:mod:`vllm_bridge.demo.rank` drives it the way vLLM's GPU model runner drives a model.
"""

from vllm_bridge.demo.model.config import ModelConfig
from vllm_bridge.demo.model.layers import AttentionMetadata
from vllm_bridge.demo.model.transformer import MoETransformer
from vllm_bridge.demo.model.weights import WeightsError, WeightsFile

__all__ = ["AttentionMetadata", "ModelConfig", "MoETransformer", "WeightsError", "WeightsFile"]
