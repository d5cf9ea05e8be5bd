"""The demo MoE transformer: embeddings, blocks of attention and MoE, norm, LM head.

Its forward pass is a list of :class:`Piece` s run in order, each mapping a tuple of
tensors to the next: the CUDA-graph manager (:mod:`vllm_bridge.demo.graphs`) captures
the whole list (FULL) or the runs of pieces between attention and the DP collectives
(PIECEWISE), which it runs eagerly; ``forward`` runs the same list, so eager and graph
runs compute the same operations.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from vllm_bridge.demo.model.config import ModelConfig
from vllm_bridge.demo.model.layers import Attention, RMSNorm, linear
from vllm_bridge.demo.model.moe import MoE

__all__ = ["MoETransformer", "Piece"]


@dataclass(frozen=True)
class Piece:
    """One step of the forward pass.

    Attributes:
        name: For logs and tests (``"embed"``, ``"layers.0.attn"``, ...).
        fn: Maps the state tuple to the next one. The first piece takes
            ``(input_ids, positions)``; the last returns ``(hidden,)``.
        kind: ``"dense"`` (graph-safe, captured in PIECEWISE graphs), ``"attention"``
            (graph-safe, eager between PIECEWISE graphs, as vLLM runs attention) or
            ``"collective"`` (the DP collectives: never captured, they may go through the
            CPU and wait with a timeout).
    """

    name: str
    fn: Callable[..., tuple[torch.Tensor, ...]]
    kind: str


class Block(nn.Module):
    """One transformer block: attention, then the MoE layer (each pre-norm, residual)."""

    def __init__(self, prefix: str, config: ModelConfig, moe: MoE) -> None:
        super().__init__()
        self.attn = Attention(
            prefix + "attn",
            config.hidden_size,
            config.num_heads,
            config.rms_norm_eps,
            config.max_model_len,
        )
        self.moe = moe

    def pieces(self) -> list[Piece]:
        """Attention, then the MoE layer: whole when it has no DP collectives, else split
        into its norm, its routed part (collectives) and the residual addition."""
        attn, moe = self.attn, self.moe
        out = [Piece(attn.prefix, lambda x, pos: (attn(x, pos), pos), "attention")]
        if moe.dp_size == 1:
            out.append(Piece(moe.prefix, lambda x, pos: (moe(x), pos), "dense"))
            return out
        return out + [
            Piece(moe.prefix + ".norm", lambda x, pos: (x, moe.norm(x), pos), "dense"),
            Piece(moe.prefix + ".routed", lambda x, h, pos: (x, moe.routed(h), pos),
                  "collective"),
            Piece(moe.prefix + ".add", lambda x, d, pos: (x + d, pos), "dense"),
        ]


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

    def pieces(self) -> list[Piece]:
        """The forward pass as pieces (see :class:`Piece`)."""
        out = [Piece("embed", lambda ids, pos: (self.embed(ids) + self.pos_embed(pos), pos),
                     "dense")]
        for block in self.layers:
            out.extend(block.pieces())
        out.append(Piece("norm", lambda x, pos: (self.norm(x),), "dense"))
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        state: tuple[torch.Tensor, ...] = (input_ids, positions)
        for piece in self.pieces():
            state = piece.fn(*state)
        return state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (float32) of the given hidden states."""
        return linear(hidden, self.lm_head).float()
