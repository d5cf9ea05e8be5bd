"""The demo MoE transformer: embeddings, blocks of attention and MoE, norm, LM head."""

import torch
from torch import nn

from vllm_bridge.demo.model.config import ModelConfig
from vllm_bridge.demo.model.layers import Attention, RMSNorm, linear
from vllm_bridge.demo.model.moe import MoE

__all__ = ["MoETransformer"]


class Block(nn.Module):
    """One transformer block: attention, then the MoE layer (each pre-norm, residual)."""

    def __init__(self, prefix: str, config: ModelConfig, moe: MoE) -> None:
        super().__init__()
        self.attn = Attention(
            prefix + "attn", config.hidden_size, config.num_heads, config.rms_norm_eps
        )
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.attn(x))


class MoETransformer(nn.Module):
    """The model of :class:`ModelConfig`; layers read the forward context.

    ``forward(input_ids, positions)`` maps a flat batch of tokens (requests laid out one
    after the other, padding at the end) to hidden states; it must run inside
    ``set_forward_context`` with attention metadata for every attention layer (see
    :mod:`vllm_bridge.demo.model.layers`). ``compute_logits`` maps chosen hidden states to
    vocabulary logits.

    Args:
        config: The model's shape.
        dp_size, dp_rank: The DP group the MoE layers run their collectives in.
        expert_parallel: Shard the experts over the DP ranks.
        moe_chunk_size: Most tokens per rank in one DP chunk of an MoE layer.
    """

    def __init__(
        self,
        config: ModelConfig,
        dp_size: int = 1,
        dp_rank: int = 0,
        expert_parallel: bool = False,
        moe_chunk_size: int = 64,
    ) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed = nn.Embedding(config.vocab_size, h)
        self.pos_embed = nn.Embedding(config.max_model_len, h)
        blocks = []
        for i in range(config.num_layers):
            prefix = f"layers.{i}."
            moe = MoE(
                prefix + "moe",
                h,
                config.intermediate_size,
                config.num_experts,
                config.top_k,
                config.rms_norm_eps,
                dp_size=dp_size,
                dp_rank=dp_rank,
                expert_parallel=expert_parallel,
                chunk_size=moe_chunk_size,
            )
            blocks.append(Block(prefix, config, moe))
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Parameter(torch.empty(h, config.vocab_size))

    def attention_layers(self) -> dict[str, Attention]:
        """The attention layers by name (the keys of ``attn_metadata``)."""
        return {block.attn.prefix: block.attn for block in self.layers}

    def moe_layer_names(self) -> list[str]:
        """The MoE layers' names in call order (``all_moe_layers``)."""
        return [block.moe.prefix for block in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos_embed(positions)
        for block in self.layers:
            x = block(x)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (float32) of the given hidden states."""
        return linear(hidden, self.lm_head).float()
