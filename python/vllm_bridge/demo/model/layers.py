"""Dense layers of the demo model: a batch-invariant linear map, RMSNorm, and causal
self-attention over a KV cache that reads its metadata from the forward context.

**Attention metadata.** As in vLLM, a forward pass's tokens are laid out request after
request; the runner puts an :class:`AttentionMetadata` for every attention layer into the
forward context's ``attn_metadata`` (a dict keyed by layer name) and each token's KV-cache
slot into ``slot_mapping`` (same keys). A layer writes the new tokens' keys and values into
its cache, then each request's queries attend to the request's cached tokens up to
themselves. Padding tokens (slot -1) write only to a scratch slot no token reads, and
their output is zero, so they cannot change the real tokens' outputs. The layer computes
from tensors alone (no host lists, no host sync), so a CUDA graph can capture it; the
metadata stays in the context for what reads it (micro-batch slicing, the layers' check).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_bridge._checks import check_int
from vllm_bridge.cudagraph import CUDAGraphMode
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
    ``slot_mapping``. The KV cache (``kv_cache``: ``(2, num_slots + 1, hidden_size)``) is
    bound by the model runner with :meth:`bind_kv_cache`; a request's region holds
    ``max_model_len`` consecutive slots.
    """

    def __init__(
        self, prefix: str, hidden_size: int, num_heads: int, eps: float, max_model_len: int
    ) -> None:
        super().__init__()
        check_int("max_model_len", max_model_len, minimum=1)
        self.prefix = prefix
        self.max_model_len = max_model_len
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.norm = RMSNorm(hidden_size, eps)
        self.qkv = nn.Parameter(torch.empty(hidden_size, 3 * hidden_size))
        self.out = nn.Parameter(torch.empty(hidden_size, hidden_size))
        self.kv_cache: torch.Tensor | None = None

    def bind_kv_cache(self, num_slots: int) -> None:
        """Allocate this layer's KV cache: ``num_slots`` token slots on its device, plus one
        scratch slot (the last) that padding tokens write to."""
        check_int("num_slots", num_slots, minimum=1)
        self.kv_cache = torch.zeros(
            2, num_slots + 1, self.qkv.shape[0], dtype=self.qkv.dtype, device=self.qkv.device
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Attention of the tokens ``x`` at ``positions`` (their slots come from the
        forward context's ``slot_mapping``).

        Capturable in a CUDA graph: every shape depends only on the number of tokens and
        ``max_model_len``, and nothing reads a tensor's value on the host. That is why it
        does not walk ``attn_metadata`` request by request (a Python loop over host lists
        whose lengths change from step to step under the same padded size): a token's
        request region starts at ``slot - position``, and the token attends to the slots
        ``start .. start + position`` of that region, masked on the device. Padding tokens
        (slot -1) write to the scratch slot and their output is zero.
        """
        context = get_forward_context()
        meta = context.attn_metadata.get(self.prefix)
        if meta is None:
            raise RuntimeError(f"{self.prefix}: the forward context has no attention metadata")
        if context.cudagraph_runtime_mode is CUDAGraphMode.FULL:
            # A FULL graph holds this layer: its shapes must not depend on the batch.
            window = self.max_model_len
        else:
            # Eager: the batch's longest sequence, from the host-side metadata (no sync);
            # a prefill then gathers its own length, not max_model_len, per token.
            lens = [
                c + meta.query_start_loc[i + 1] - meta.query_start_loc[i]
                for i, c in enumerate(meta.context_lens)
            ]
            window = min(self.max_model_len, max(lens, default=1))
        slots = context.slot_mapping[self.prefix]
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError(f"{self.prefix}: no KV cache bound (call bind_kv_cache first)")
        scratch = cache.shape[1] - 1
        q, k, v = linear(self.norm(x), self.qkv).chunk(3, dim=-1)
        real = slots >= 0
        write = torch.where(real, slots, torch.full_like(slots, scratch))
        cache[0].index_copy_(0, write, k)
        cache[1].index_copy_(0, write, v)
        out = self._attend(cache, q, slots, positions, real, window)
        return x + linear(out, self.out)

    def _attend(
        self,
        cache: torch.Tensor,
        q: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        real: torch.Tensor,
        window: int,
    ) -> torch.Tensor:
        n, heads, d = q.shape[0], self.num_heads, self.head_dim
        scratch = cache.shape[1] - 1
        start = torch.where(real, slots - positions, torch.zeros_like(slots))
        offsets = torch.arange(window, device=q.device)
        index = (start[:, None] + offsets[None, :]).clamp(0, scratch).reshape(-1)
        keys = cache[0].index_select(0, index).view(n, window, heads, d).permute(0, 2, 3, 1)
        values = cache[1].index_select(0, index).view(n, window, heads, d).transpose(1, 2)
        queries = q.view(n, heads, 1, d)
        scores = torch.matmul(queries, keys).float() * self.scale  # (n, heads, 1, window)
        # A token at position p sees its request's keys 0 .. p; a padding token sees key 0
        # only (so its softmax is defined) and its output is zeroed below.
        limit = torch.where(real, positions, torch.zeros_like(positions))
        allowed = offsets[None, :] <= limit[:, None]
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
        probs = F.softmax(scores, dim=-1).to(q.dtype)
        out = torch.matmul(probs, values).reshape(n, heads * d)
        return out * real[:, None].to(out.dtype)
