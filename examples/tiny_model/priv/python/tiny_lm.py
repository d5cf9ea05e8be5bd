"""A tiny next-token model for the vllm_bridge example app.

Each worker process holds one model (a module global), built by :func:`setup` from a
seed, so every worker of a pool, and a worker after a restart, holds the same weights. The
pool runs :func:`setup` in every worker before it takes a call (the pool option
``on_start: {"tiny_lm", "setup", [...]}``).

:func:`forward` must run under ``vllm_bridge.forward_context.set_forward_context``: it reads
the forward context as a vLLM model does. With data parallelism on, it pads its tokens to
the largest count over the DP ranks (``dp_metadata``), as every rank must run a pass of the
same size; a ``batch_descriptor`` pads further, to the size of the graph it names; and the
per-layer attention metadata (``attn_metadata``, a dict by layer name) scales each layer.
What it read comes back in :class:`ContextSeen`, beside the logits.

The model works token by token (no attention), so a token's logits do not depend on the
other tokens of its batch: a DP pair's results agree with one rank running every token.
"""

import os
from dataclasses import dataclass

import torch
from torch import nn

from vllm_bridge.forward_context import get_forward_context

__all__ = ["ContextSeen", "ForwardOutput", "ModelInfo", "forward", "model_info", "setup"]


@dataclass
class ModelInfo:
    """The model a worker holds.

    Attributes:
        seed: The seed its weights were drawn from.
        vocab_size: Tokens it knows (ids ``0..vocab_size-1``).
        hidden_size: Width of its hidden layers.
        num_layers: Hidden layers (named ``layers.0``, ``layers.1``, ...).
        num_parameters: Parameters, all layers together.
        checksum: Sum of every parameter (equal weights give equal sums).
        os_pid: The worker's process id.
        setup_calls: How many times :func:`setup` ran in this process.
        dp_rank: The worker's DP rank (``VLLM_DP_RANK``), ``None`` outside a DP pool.
    """

    seed: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_parameters: int
    checksum: float
    os_pid: int
    setup_calls: int
    dp_rank: int | None = None


@dataclass
class ContextSeen:
    """What :func:`forward` read from the forward context.

    Attributes:
        num_tokens: Tokens given to this pass.
        padded_tokens: Tokens the pass ran: ``num_tokens`` padded to the DP maximum and
            to the batch descriptor's size.
        num_tokens_across_dp: Every DP rank's token count (``dp_metadata``), ``None``
            without DP.
        batch_descriptor_tokens: The batch descriptor's ``num_tokens``, ``None`` without one.
        cudagraph_mode: The context's CUDA-graph runtime mode, by name (``"NONE"``, ...).
        virtual_engine: The context's virtual engine.
        scaled_layers: The layers that found a scale in ``attn_metadata``.
    """

    num_tokens: int
    padded_tokens: int
    num_tokens_across_dp: list[int] | None
    batch_descriptor_tokens: int | None
    cudagraph_mode: str
    virtual_engine: int
    scaled_layers: list[str]


@dataclass
class ForwardOutput:
    """The result of one forward pass.

    Attributes:
        logits: ``[num_tokens, vocab_size]`` float32 logits of the next token.
        next_tokens: The most likely next token of each input token.
        context: What the pass read from the forward context.
    """

    logits: torch.Tensor
    next_tokens: list[int]
    context: ContextSeen


class _TinyLM(nn.Module):
    """Embedding, ``num_layers`` residual MLP layers, and a head tied to the embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden_size)

    def forward(self, token_ids: torch.Tensor, scales: list[float]) -> torch.Tensor:
        h = self.embed(token_ids)
        for layer, scale in zip(self.layers, scales, strict=True):
            h = h + scale * torch.tanh(layer(h))
        return self.norm(h) @ self.embed.weight.T


@dataclass
class _Loaded:
    model: _TinyLM
    seed: int


_loaded: _Loaded | None = None
_setup_calls = 0


def _check_int(name: str, value: object, low: int, high: int) -> int:
    # bool is an int in Python; a flag where a count goes is a caller's mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be from {low} to {high}, got {value!r}")
    return value


def setup(seed: int = 0, vocab_size: int = 64, hidden_size: int = 32, num_layers: int = 2) -> ModelInfo:
    """Build this process's model from ``seed`` (replacing any earlier one).

    The weights are drawn from a generator seeded with ``seed``, so every process that runs
    ``setup`` with the same arguments holds the same model. Meant as a pool's ``on_start``.

    Raises:
        TypeError / ValueError: an argument that is not an int in its range.
    """
    global _loaded, _setup_calls
    _check_int("seed", seed, 0, 2**63 - 1)
    _check_int("vocab_size", vocab_size, 2, 1 << 20)
    _check_int("hidden_size", hidden_size, 1, 4096)
    _check_int("num_layers", num_layers, 1, 64)
    generator = torch.Generator().manual_seed(seed)
    model = _TinyLM(vocab_size, hidden_size, num_layers)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    model.eval()
    _loaded = _Loaded(model, seed)
    _setup_calls += 1
    return model_info()


def _current() -> _Loaded:
    if _loaded is None:
        raise RuntimeError("no model in this worker: tiny_lm.setup() has not run in it")
    return _loaded


def model_info() -> ModelInfo:
    """The model this worker holds.

    Raises:
        RuntimeError: :func:`setup` has not run in this process.
    """
    loaded = _current()
    model = loaded.model
    rank = os.environ.get("VLLM_DP_RANK")
    with torch.no_grad():
        checksum = float(sum(p.double().sum() for p in model.parameters()))
    return ModelInfo(
        seed=loaded.seed,
        vocab_size=model.embed.num_embeddings,
        hidden_size=model.embed.embedding_dim,
        num_layers=len(model.layers),
        num_parameters=sum(p.numel() for p in model.parameters()),
        checksum=checksum,
        os_pid=os.getpid(),
        setup_calls=_setup_calls,
        dp_rank=int(rank) if rank is not None else None,
    )


def _layer_scales(attn_metadata: object, num_layers: int) -> tuple[list[float], list[str]]:
    # attn_metadata: None, or a dict by layer name whose entries may carry a "scale".
    scales = [1.0] * num_layers
    seen: list[str] = []
    if attn_metadata is None:
        return scales, seen
    if not isinstance(attn_metadata, dict):
        raise TypeError(f"attn_metadata must be a dict by layer name or None, got {attn_metadata!r}")
    for i in range(num_layers):
        entry = attn_metadata.get(f"layers.{i}")
        if isinstance(entry, dict) and "scale" in entry:
            scale = entry["scale"]
            if not isinstance(scale, (int, float)) or isinstance(scale, bool):
                raise TypeError(f"attn_metadata['layers.{i}']['scale'] must be a number, got {scale!r}")
            scales[i] = float(scale)
            seen.append(f"layers.{i}")
    return scales, seen


def forward(token_ids: list[int]) -> ForwardOutput:
    """Run the model on ``token_ids`` under the current forward context.

    Pads the tokens to the largest count over the DP ranks (``dp_metadata``) and to the
    batch descriptor's ``num_tokens``, scales layer ``layers.i`` by
    ``attn_metadata["layers.i"]["scale"]`` when given, and returns the logits of the given
    tokens only.

    Raises:
        RuntimeError: no forward context is set, or :func:`setup` has not run.
        TypeError / ValueError: ``token_ids`` is not a non-empty list of token ids below
            the vocabulary size.
    """
    ctx = get_forward_context()
    loaded = _current()
    vocab = loaded.model.embed.num_embeddings
    if not isinstance(token_ids, list) or not token_ids:
        raise TypeError(f"token_ids must be a non-empty list of ints, got {token_ids!r}")
    for i, token in enumerate(token_ids):
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
            raise ValueError(f"token_ids[{i}] must be a token id from 0 to {vocab - 1}, got {token!r}")
    n = len(token_ids)
    padded = n
    across: list[int] | None = None
    if ctx.dp_metadata is not None:
        across = [int(c) for c in ctx.dp_metadata.num_tokens_across_dp_cpu.tolist()]
        padded = max(padded, int(ctx.dp_metadata.max_tokens_across_dp_cpu))
    descriptor = ctx.batch_descriptor
    if descriptor is not None:
        padded = max(padded, descriptor.num_tokens)
    scales, seen = _layer_scales(ctx.attn_metadata, len(loaded.model.layers))
    ids = torch.zeros(padded, dtype=torch.long)
    ids[:n] = torch.tensor(token_ids, dtype=torch.long)
    with torch.no_grad():
        logits = loaded.model(ids, scales)[:n].contiguous()
    return ForwardOutput(
        logits=logits,
        next_tokens=[int(t) for t in logits.argmax(dim=-1).tolist()],
        context=ContextSeen(
            num_tokens=n,
            padded_tokens=padded,
            num_tokens_across_dp=across,
            batch_descriptor_tokens=descriptor.num_tokens if descriptor is not None else None,
            cudagraph_mode=ctx.cudagraph_runtime_mode.name,
            virtual_engine=ctx.virtual_engine,
            scaled_layers=seen,
        ),
    )
