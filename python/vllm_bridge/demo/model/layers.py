"""Dense layers of the demo model: a batch-invariant linear map, RMSNorm, and causal
self-attention over a KV cache that reads its metadata from the forward context.

**Attention metadata.** As in vLLM, a forward pass's tokens are laid out request after
request; the runner puts an :class:`AttentionMetadata` for every attention layer into the
forward context's ``attn_metadata`` (a dict keyed by layer name) and each token's KV-cache
slot into ``slot_mapping`` (same keys). A layer writes the new tokens' keys and values into
its cache, then each request's queries attend to the request's cached tokens up to
themselves. Padding tokens (slot -1) are neither written nor attended to; their output is
zero, so they cannot change the real tokens' outputs.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_bridge._checks import check_int
from vllm_bridge.forward_context import get_forward_context

__all__ = ["Attention", "AttentionMetadata", "RMSNorm", "linear"]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight`` (``weight`` stored ``(in, out)``), computed so that a row's result
    does not depend on how many rows come with it.

    BLAS libraries route a single row to a matrix-vector kernel that sums in another order
    than the matrix-matrix kernel; a lone row is therefore computed as two (itself and a
    zero row). Running the same tokens in batches of different sizes (one DP rank versus
    two, padded or not) then gives the same bits wherever the matrix-matrix kernel is
    itself row-independent (MKL on x86 here; other libraries may differ in the last bits).
    """
    if x.shape[0] == 1:
        return (torch.cat([x, torch.zeros_like(x)]) @ weight)[:1]
    return x @ weight


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned scale (``weight``)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


@dataclass
class AttentionMetadata:
    """Where each request's tokens sit in one (micro-)batch and in the KV cache.

    Attributes:
        query_start_loc: Token offsets of the requests in this batch (``num_reqs + 1``
            entries, from 0 to ``num_actual_tokens``).
        context_lens: Tokens of each request already in the KV cache before this batch.
        kv_starts: First KV-cache slot of each request's region (a request's token at
            position ``p`` lives in slot ``kv_starts[i] + p``).
        num_actual_tokens: Real tokens in the batch; those after them are padding.
    """

    query_start_loc: list[int]
    context_lens: list[int]
    kv_starts: list[int]
    num_actual_tokens: int

    def __post_init__(self) -> None:
        n = len(self.context_lens)
        if len(self.query_start_loc) != n + 1 or len(self.kv_starts) != n:
            raise ValueError(
                f"AttentionMetadata: {len(self.query_start_loc)} query_start_loc entries, "
                f"{n} context_lens and {len(self.kv_starts)} kv_starts do not describe the "
                "same requests (query_start_loc needs num_reqs + 1 entries)"
            )
        if self.query_start_loc and self.query_start_loc[-1] != self.num_actual_tokens:
            raise ValueError(
                f"AttentionMetadata: query_start_loc ends at {self.query_start_loc[-1]}, "
                f"not at num_actual_tokens ({self.num_actual_tokens})"
            )

    @property
    def num_reqs(self) -> int:
        """Number of requests (whole or partial) in the batch."""
        return len(self.context_lens)

    def slice(self, start: int, stop: int) -> "AttentionMetadata":
        """The metadata of the tokens ``start:stop`` of this batch (a micro-batch).

        A request cut by ``start`` keeps its earlier tokens as context (they are in the
        cache once the micro-batch before has run); padding beyond the real tokens stays
        padding.
        """
        check_int("start", start, minimum=0)
        check_int("stop", stop, minimum=start)
        qsl, ctx, kvs = [0], [], []
        for i in range(self.num_reqs):
            lo, hi = self.query_start_loc[i], self.query_start_loc[i + 1]
            a, b = max(lo, start), min(hi, stop)
            if a >= b:
                continue
            qsl.append(qsl[-1] + b - a)
            ctx.append(self.context_lens[i] + a - lo)
            kvs.append(self.kv_starts[i])
        return AttentionMetadata(qsl, ctx, kvs, qsl[-1])


class Attention(nn.Module):
    """Pre-norm causal multi-head self-attention with a residual connection.

    ``prefix`` is the layer's name in the forward context's ``attn_metadata`` and
    ``slot_mapping``. The KV cache (``kv_cache``: ``(2, num_slots, hidden_size)``) is bound
    by the model runner with :meth:`bind_kv_cache`.
    """

    def __init__(self, prefix: str, hidden_size: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.prefix = prefix
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.norm = RMSNorm(hidden_size, eps)
        self.qkv = nn.Parameter(torch.empty(hidden_size, 3 * hidden_size))
        self.out = nn.Parameter(torch.empty(hidden_size, hidden_size))
        self.kv_cache: torch.Tensor | None = None

    def bind_kv_cache(self, num_slots: int) -> None:
        """Allocate this layer's KV cache: ``num_slots`` token slots on its device."""
        check_int("num_slots", num_slots, minimum=1)
        self.kv_cache = torch.zeros(
            2, num_slots, self.qkv.shape[0], dtype=self.qkv.dtype, device=self.qkv.device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        meta = context.attn_metadata[self.prefix]
        slots = context.slot_mapping[self.prefix]
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError(f"{self.prefix}: no KV cache bound (call bind_kv_cache first)")
        real = meta.num_actual_tokens
        q, k, v = linear(self.norm(x), self.qkv).chunk(3, dim=-1)
        cache[0, slots[:real]] = k[:real]
        cache[1, slots[:real]] = v[:real]
        out = torch.zeros_like(q)
        for i in range(meta.num_reqs):
            lo, hi = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[lo:hi] = self._attend(cache, q[lo:hi], meta.kv_starts[i], meta.context_lens[i])
        return x + linear(out, self.out)

    def _attend(
        self, cache: torch.Tensor, q: torch.Tensor, kv_start: int, context_len: int
    ) -> torch.Tensor:
        n, seq = q.shape[0], context_len + q.shape[0]
        heads, d = self.num_heads, self.head_dim
        keys = cache[0, kv_start : kv_start + seq].view(seq, heads, d).transpose(0, 1)
        values = cache[1, kv_start : kv_start + seq].view(seq, heads, d).transpose(0, 1)
        queries = q.view(n, heads, d).transpose(0, 1)
        scores = torch.matmul(queries, keys.transpose(1, 2)).float() * self.scale
        # Query j sits at position context_len + j and sees keys 0 .. context_len + j.
        allowed = torch.arange(seq, device=q.device)[None, :] <= (
            context_len + torch.arange(n, device=q.device)[:, None]
        )
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = F.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, values).transpose(0, 1).reshape(n, heads * d)
