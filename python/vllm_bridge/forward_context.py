"""The forward context: per-forward-pass metadata that model layers read without plumbing.

Work in progress: this first step holds :class:`BatchDescriptor`; the rest of the module
(DPMetadata, ForwardContext and the context managers) follows.
"""

from dataclasses import dataclass

from vllm_bridge._checks import check_bool, check_int, check_optional_int

__all__ = ["BatchDescriptor"]


@dataclass(frozen=True)
class BatchDescriptor:
    """Describes a padded batch for CUDA-graph dispatch; immutable and hashable.

    Two batches with equal descriptors can replay the same CUDA graph, so the descriptor is
    used as a dictionary key. Keep it minimal: only what distinguishes one graph from another.

    Attributes:
        num_tokens: Number of (padded) tokens in the batch.
        num_reqs: Number of requests in the batch; ``None`` for PIECEWISE graphs, which
            handle any number of requests.
        uniform: True when every request in the batch has the same number of tokens.
        has_lora: True when the batch has active LoRA adapters.
        num_active_loras: Number of distinct active LoRA adapters in the batch (separate
            graphs may be captured per count).
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    has_lora: bool = False
    num_active_loras: int = 0

    def __post_init__(self) -> None:
        check_int("BatchDescriptor.num_tokens", self.num_tokens, minimum=0)
        check_optional_int("BatchDescriptor.num_reqs", self.num_reqs, minimum=0)
        check_bool("BatchDescriptor.uniform", self.uniform)
        check_bool("BatchDescriptor.has_lora", self.has_lora)
        check_int("BatchDescriptor.num_active_loras", self.num_active_loras, minimum=0)

    def relax_for_mixed_batch_cudagraphs(self) -> "BatchDescriptor":
        """A descriptor for the same token count that PIECEWISE (mixed-batch) graphs accept.

        Drops ``num_reqs`` and ``uniform`` (reset to their defaults) and keeps the LoRA
        fields, which still select the graph.
        """
        return BatchDescriptor(
            num_tokens=self.num_tokens,
            num_reqs=None,
            uniform=False,
            has_lora=self.has_lora,
            num_active_loras=self.num_active_loras,
        )
