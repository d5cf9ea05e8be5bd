"""The shape of the demo MoE transformer: sizes, dtype and the names of its tensors."""

from dataclasses import asdict, dataclass
from typing import Any

import torch

from vllm_bridge._checks import check_int

__all__ = ["DTYPES", "ModelConfig"]

#: dtype names a model may use, and the torch dtype of each.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class ModelConfig:
    """A small mixture-of-experts decoder: token + learned position embeddings, then
    ``num_layers`` blocks of (RMSNorm, causal self-attention) and (RMSNorm, MoE of
    SwiGLU experts with top-k routing), a final RMSNorm and an LM head.

    Attributes:
        vocab_size: Number of token ids.
        hidden_size: Width of the residual stream; a multiple of ``num_heads``.
        num_layers: Number of transformer blocks.
        num_heads: Attention heads per layer.
        num_experts: Experts per MoE layer.
        top_k: Experts each token is routed to (at most ``num_experts``).
        intermediate_size: Hidden width of each expert's SwiGLU.
        max_model_len: Longest request (positions are ``0 .. max_model_len - 1``).
        rms_norm_eps: Epsilon of every RMSNorm.
        dtype: Parameter and activation dtype, a key of :data:`DTYPES`.
    """

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    intermediate_size: int = 128
    max_model_len: int = 256
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_experts",
            "top_k",
            "intermediate_size",
            "max_model_len",
        ):
            check_int(f"ModelConfig.{name}", getattr(self, name), minimum=1)
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelConfig.hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_heads ({self.num_heads})"
            )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"ModelConfig.top_k ({self.top_k}) must be <= num_experts ({self.num_experts})"
            )
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be a number > 0, got {eps!r}")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"ModelConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype named by :attr:`dtype`."""
        return DTYPES[self.dtype]

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (what a weights file records)."""
        return asdict(self)

    @staticmethod
    def from_dict(fields: Any) -> "ModelConfig":
        """Build a config from :meth:`to_dict` output; unknown keys are an error.

        Raises:
            TypeError: ``fields`` is not a dict.
            ValueError: an unknown field, or a value the config refuses.
        """
        if not isinstance(fields, dict):
            raise TypeError(f"a model config must be a dict of fields, got {fields!r}")
        known = set(ModelConfig.__dataclass_fields__)
        unknown = sorted(str(k) for k in fields if k not in known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; known: {sorted(known)}")
        return ModelConfig(**{str(k): v for k, v in fields.items()})

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's name and full (unsharded) shape, in model order.

        Linear weights are stored ``(in_features, out_features)`` (used as ``x @ w``);
        expert weights are stacked over experts on dimension 0.
        """
        h, f, e = self.hidden_size, self.intermediate_size, self.num_experts
        shapes: dict[str, tuple[int, ...]] = {
            "embed.weight": (self.vocab_size, h),
            "pos_embed.weight": (self.max_model_len, h),
        }
        for i in range(self.num_layers):
            p = f"layers.{i}."
            shapes[p + "attn.norm.weight"] = (h,)
            shapes[p + "attn.qkv"] = (h, 3 * h)
            shapes[p + "attn.out"] = (h, h)
            shapes[p + "moe.norm.weight"] = (h,)
            shapes[p + "moe.router"] = (h, e)
            shapes[p + "moe.w_gate"] = (e, h, f)
            shapes[p + "moe.w_up"] = (e, h, f)
            shapes[p + "moe.w_down"] = (e, f, h)
        shapes["norm.weight"] = (h,)
        shapes["lm_head"] = (h, self.vocab_size)
        return shapes

    @staticmethod
    def is_expert_parameter(name: str) -> bool:
        """True for the stacked expert weights, which expert parallelism shards on dim 0."""
        return name.rsplit(".", 1)[-1] in ("w_gate", "w_up", "w_down")
