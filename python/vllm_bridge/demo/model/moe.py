"""The mixture-of-experts layer, and how data-parallel ranks run it together.

**Routing.** Each token's router logits (``x @ router``) go through a softmax; the token
goes to its ``top_k`` experts with those probabilities renormalised to sum to 1. An expert
is a SwiGLU MLP: ``(silu(x @ w_gate) * (x @ w_up)) @ w_down``. A token's output is
``sum_k weight_k * expert_k(x)``, summed over ``k`` in routing order, one addition at a
time (so the order is the same however many tokens come together).

**Without DP** (no ``dp_metadata`` in the forward context) a rank routes and runs its own
tokens through all experts.

**With DP** (the forward context carries :class:`~vllm_bridge.forward_context.DPMetadata`)
the ranks process the MoE layer together, in chunks of at most ``chunk_size`` tokens per
rank, as vLLM's naive all-gather dispatch does:

1. The number of chunks is ``ceil(max_tokens_across_dp / chunk_size)``, the same on every
   rank, so every rank runs the same collectives in the same order (lockstep). A rank that
   has run out of tokens still takes part, with one zero row
   (``DPMetadata.chunked_sizes`` never reports fewer than 1 token).
2. Inside ``dp_metadata.chunked_sizes(1, chunk_size, c)`` each rank pads its chunk to the
   largest of ``local_sizes`` and the ranks all-gather it: every rank now holds every
   rank's chunk tokens, rank after rank.
3. With expert parallelism (``enable_expert_parallel``) rank ``r`` owns experts
   ``r * E/dp .. (r + 1) * E/dp - 1`` and computes, for every gathered token, the
   contributions ``weight_k * expert_k(x)`` of the experts it owns, leaving the others
   zero. One all-reduce (sum) then gives every rank every contribution. Exactly one rank
   wrote each (token, k) entry and the others added zeros, so the sum is exact: no
   summation order across ranks enters the result. Without expert parallelism every rank
   holds all experts and computes everything itself.
4. Each rank combines the contributions (over ``k``, in order) and keeps the rows of its
   own tokens.

A token's output therefore depends only on the token itself, never on which other tokens
(or how many, or padding) came along; this is what makes a DP run equal to one rank
running the same tokens.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from vllm_bridge._checks import check_int
from vllm_bridge.demo.model.layers import RMSNorm, linear
from vllm_bridge.dp import dp_all_gather, dp_all_reduce
from vllm_bridge.forward_context import DPMetadata, get_forward_context

__all__ = ["MoE", "expert_shard"]


def expert_shard(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """``(first_expert, count)`` owned by expert-parallel rank ``ep_rank`` of ``ep_size``.

    Raises:
        ValueError: the experts do not split evenly over the ranks, or a bad rank.
    """
    check_int("num_experts", num_experts, minimum=1)
    check_int("ep_size", ep_size, minimum=1)
    check_int("ep_rank", ep_rank, minimum=0)
    if ep_rank >= ep_size:
        raise ValueError(f"ep_rank must be < ep_size ({ep_size}), got {ep_rank}")
    if num_experts % ep_size:
        raise ValueError(
            f"num_experts ({num_experts}) must be a multiple of the expert-parallel size "
            f"({ep_size}) so that every rank owns the same number of experts"
        )
    count = num_experts // ep_size
    return ep_rank * count, count


class MoE(nn.Module):
    """Pre-norm top-k mixture of SwiGLU experts with a residual connection.

    Args:
        prefix: The layer's name (checked against the forward context's MoE layer order).
        hidden_size, intermediate_size, num_experts, top_k, eps: The model's sizes.
        dp_size, dp_rank: The data-parallel group this layer's collectives run in.
        expert_parallel: Shard the experts over the DP ranks (else every rank has all).
        chunk_size: Most tokens per rank in one DP chunk.
    """

    def __init__(
        self,
        prefix: str,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        eps: float,
        dp_size: int = 1,
        dp_rank: int = 0,
        expert_parallel: bool = False,
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        check_int("chunk_size", chunk_size, minimum=1)
        self.prefix = prefix
        self.top_k = top_k
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.ep_size = dp_size if expert_parallel else 1
        ep_rank = dp_rank if expert_parallel else 0
        self.first_expert, self.num_local = expert_shard(num_experts, self.ep_size, ep_rank)
        self.chunk_size = chunk_size
        h, f, e = hidden_size, intermediate_size, self.num_local
        self.norm = RMSNorm(hidden_size, eps)
        self.router = nn.Parameter(torch.empty(h, num_experts))
        self.w_gate = nn.Parameter(torch.empty(e, h, f))
        self.w_up = nn.Parameter(torch.empty(e, h, f))
        self.w_down = nn.Parameter(torch.empty(e, f, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.routed(self.norm(x))

    def routed(self, h: torch.Tensor) -> torch.Tensor:
        """The experts' combined output for the normalised tokens ``h`` (no residual): the
        part of the layer that runs the DP collectives when the context has DP metadata
        (the model runs it eagerly between PIECEWISE graphs)."""
        context = get_forward_context()
        if context.all_moe_layers:
            expected = context.all_moe_layers[context.moe_layer_index]
            if expected != self.prefix:
                raise RuntimeError(
                    f"MoE layer {self.prefix} ran where the forward context expected "
                    f"{expected} (all_moe_layers {context.all_moe_layers})"
                )
            context.moe_layer_index += 1
        if context.dp_metadata is None:
            if self.ep_size > 1:
                raise RuntimeError(
                    f"{self.prefix} shards its experts over {self.ep_size} DP ranks but the "
                    "forward context has no dp_metadata (set_forward_context needs num_tokens)"
                )
            return self._combine(self._contributions(h))
        return self._forward_dp(h, context.dp_metadata)

    def _forward_dp(self, h: torch.Tensor, meta: DPMetadata) -> torch.Tensor:
        n = h.shape[0]
        out = torch.empty_like(h)
        max_tokens = int(meta.max_tokens_across_dp_cpu)
        num_chunks = max(1, math.ceil(max_tokens / self.chunk_size))
        for c in range(num_chunks):
            with meta.chunked_sizes(1, self.chunk_size, c) as sizes:
                start = min(c * self.chunk_size, n)
                mine = h[start : start + self.chunk_size]
                padded = h.new_zeros(max(sizes), h.shape[1])
                padded[: mine.shape[0]] = mine
                gathered = dp_all_gather(padded, self.dp_size, self.dp_rank)
                tokens = torch.cat([gathered[r, : sizes[r]] for r in range(self.dp_size)])
                contrib = self._contributions(tokens)
                if self.ep_size > 1:
                    contrib = dp_all_reduce(contrib, self.dp_size, self.dp_rank)
                first = sum(sizes[: self.dp_rank])
                mine_out = self._combine(contrib[first : first + mine.shape[0]])
                out[start : start + mine.shape[0]] = mine_out
        return out

    def _contributions(self, h: torch.Tensor) -> torch.Tensor:
        """``(tokens, top_k, hidden)``: ``weight_k * expert_k(h)`` for the experts this rank
        owns, zero for the others.

        Capturable in a CUDA graph: every local expert runs on every token (a fixed
        shape), and each (token, k) entry keeps its expert's output where the routing chose
        that expert (a device-side select). The former version gathered each expert's
        tokens with ``nonzero`` and skipped idle experts with ``numel() == 0``: both read
        device values on the host (a sync) and give data-dependent shapes, which a graph
        cannot hold. A row's values are the same as before (the same products, computed
        row by row by :func:`linear`); only idle (token, expert) pairs cost more work.
        """
        probs = F.softmax(linear(h, self.router).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(h.dtype)
        contrib = h.new_zeros(h.shape[0], self.top_k, h.shape[1])
        for local in range(self.num_local):
            act = F.silu(linear(h, self.w_gate[local])) * linear(h, self.w_up[local])
            out = linear(act, self.w_down[local])
            chosen = experts == self.first_expert + local  # (tokens, top_k)
            contrib = torch.where(chosen[:, :, None], out[:, None, :] * weights[:, :, None],
                                  contrib)
        return contrib

    @staticmethod
    def _combine(contrib: torch.Tensor) -> torch.Tensor:
        """Sum over ``k`` in routing order, one addition at a time."""
        out = contrib[:, 0].clone()
        for k in range(1, contrib.shape[1]):
            out = out + contrib[:, k]
        return out
