"""The forward context: per-forward-pass metadata that model layers read without plumbing.

A model runner wraps each forward pass in :func:`set_forward_context`; code deep inside the
model calls :func:`get_forward_context` for the attention metadata, the DP token counts
(:class:`DPMetadata`), the CUDA-graph runtime mode and :class:`BatchDescriptor`, and the
micro-batch slices.

The current context lives in a :class:`contextvars.ContextVar`, so every thread, and every
bridge session (each runs in its own ``contextvars.Context``), has its own: one never sees
another's. ``_forward_context`` (a module attribute) reads the current one, or ``None``.

Batch-size tracking (see :mod:`vllm_bridge.batchsize`) is exposed here as the module
attributes ``track_batchsize``, ``batchsize_logging_interval``, ``batchsize_forward_time``,
``forward_start_time`` and ``last_logging_time`` (read live), and the functions
:func:`get_batchsize_stats`, :func:`configure_batchsize_tracking` and
:func:`reset_batchsize_stats`.
"""

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

# Checks and bodies: everything callers call stays defined here (docs/SECURITY.md).
from vllm_bridge import _forward_context_impl as _impl
from vllm_bridge import batchsize as _batchsize
from vllm_bridge._checks import check_instance
from vllm_bridge.config import ParallelConfig, VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.dp import coordinate_batch_across_dp
from vllm_bridge.platforms import current_platform
from vllm_bridge.ubatch import UBatchSlices

__all__ = [
    "BatchDescriptor",
    "DPMetadata",
    "ForwardContext",
    "UBatchSlices",
    "batchsize_forward_time",
    "batchsize_logging_interval",
    "configure_batchsize_tracking",
    "coordinate_batch_across_dp",
    "create_forward_context",
    "current_platform",
    "forward_start_time",
    "get_batchsize_stats",
    "get_forward_context",
    "init_logger",
    "is_forward_context_available",
    "last_logging_time",
    "override_forward_context",
    "reset_batchsize_stats",
    "set_forward_context",
    "track_batchsize",
]

logger = logging.getLogger(__name__)


# The batch-size functions of the forward-context API are defined here, not re-exported
# from vllm_bridge.batchsize: a caller may call only code defined in an allow-listed module
# (docs/SECURITY.md), and vllm_bridge.batchsize is not one.


def configure_batchsize_tracking(interval_s: float) -> None:
    """Turn tracking on (``interval_s >= 0``, seconds between log lines) or off (< 0)."""
    _batchsize.configure_batchsize_tracking(interval_s)


def reset_batchsize_stats() -> None:
    """Forget every recorded forward time and the time of the last log line."""
    _batchsize.reset_batchsize_stats()


def get_batchsize_stats(min_count: int = 2) -> list[tuple[int | None, int, float]]:
    """The recorded stats: ``(batchsize, count, median_time_ms)`` sorted by count, descending.

    Args:
        min_count: Leave out batch sizes recorded fewer times than this (the log leaves out
            sizes seen once).
    """
    return _batchsize.get_batchsize_stats(min_count)


def init_logger(name: str) -> logging.Logger:
    """The logger called ``name`` (a standard :mod:`logging` logger)."""
    return _impl.logger_named(name)


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
        _impl.check_batch_descriptor(self)

    def relax_for_mixed_batch_cudagraphs(self) -> "BatchDescriptor":
        """A descriptor for the same token count that PIECEWISE (mixed-batch) graphs accept.

        Drops ``num_reqs`` and ``uniform`` (reset to their defaults) and keeps the LoRA
        fields, which still select the graph.
        """
        return dataclasses.replace(self, num_reqs=None, uniform=False)


def _compute_sp_num_tokens(
    num_tokens_across_dp_cpu: torch.Tensor | list[int], sequence_parallel_size: int
) -> list[int]:
    """Per sequence-parallel rank token counts: each DP rank's count split over ``sp`` ranks.

    Each DP rank's count is ceil-divided by ``sequence_parallel_size`` and repeated that many
    times, e.g. ``[5, 3]`` with sp 2 gives ``[3, 3, 2, 2]``.
    """
    return _impl.sp_num_tokens(num_tokens_across_dp_cpu, sequence_parallel_size)


def _compute_chunked_local_num_tokens(
    num_tokens_across_dp_cpu: torch.Tensor | list[int],
    sequence_parallel_size: int,
    max_num_tokens: int,
    chunk_idx: int,
) -> list[int]:
    """Per-rank token counts of chunk ``chunk_idx`` of at most ``max_num_tokens`` tokens.

    For each sequence-parallel rank (see :func:`_compute_sp_num_tokens`) the chunk holds
    ``min(max_num_tokens, tokens left)``, and never fewer than 1, so a rank that has run out
    keeps stepping in lockstep with the others.
    """
    return _impl.chunked_local_num_tokens(
        num_tokens_across_dp_cpu, sequence_parallel_size, max_num_tokens, chunk_idx
    )


@dataclass
class DPMetadata:
    """Data-parallel token counts of one forward pass.

    Attributes:
        max_tokens_across_dp_cpu: The largest count over the DP ranks (0-d CPU tensor).
        num_tokens_across_dp_cpu: Every DP rank's token count (1-D CPU tensor).
        local_sizes: Per-rank sizes of the current chunk; set only inside
            :meth:`chunked_sizes` / :meth:`sp_local_sizes`, ``None`` elsewhere.
    """

    max_tokens_across_dp_cpu: torch.Tensor
    num_tokens_across_dp_cpu: torch.Tensor
    local_sizes: list[int] | None = None

    def __post_init__(self) -> None:
        _impl.check_dp_metadata(self)

    @staticmethod
    def make(
        parallel_config: ParallelConfig,
        num_tokens: int,
        num_tokens_across_dp_cpu: torch.Tensor | list[int],
    ) -> "DPMetadata":
        """Build DP metadata for this rank's ``num_tokens`` and every rank's counts.

        Raises:
            ValueError: DP is off, the model is marked non-MoE, the counts have the wrong
                length, or this rank's entry differs from ``num_tokens``.
        """
        counts = _impl.dp_counts(parallel_config, num_tokens, num_tokens_across_dp_cpu)
        return DPMetadata(torch.max(counts), counts)

    @contextmanager
    def chunked_sizes(
        self, sequence_parallel_size: int, max_chunk_size_per_rank: int, chunk_idx: int
    ) -> Iterator[list[int]]:
        """Set ``local_sizes`` to every rank's token count in chunk ``chunk_idx``, inside only.

        For chunked execution each rank splits its tokens into chunks of at most
        ``max_chunk_size_per_rank``; ranks with fewer tokens still step through every chunk
        (with a count of at least 1) so that all ranks stay in lockstep. ``local_sizes``
        is reset to ``None`` on exit, also when the body raises.

        Args:
            sequence_parallel_size: Sequence-parallel size (attention TP with MoE EP splits
                each DP rank's tokens over this many ranks).
            max_chunk_size_per_rank: The most tokens one rank processes in a chunk.
            chunk_idx: Which chunk.

        Yields:
            The per-rank sizes (also in ``self.local_sizes``).
        """
        chunk = (sequence_parallel_size, max_chunk_size_per_rank, chunk_idx)
        sizes = _compute_chunked_local_num_tokens(self.num_tokens_across_dp_cpu, *chunk)
        yield from _impl.holding_local_sizes(self, sizes)

    @contextmanager
    def sp_local_sizes(self, sequence_parallel_size: int) -> Iterator[list[int]]:
        """Like :meth:`chunked_sizes` without chunking: each sequence-parallel rank's count."""
        sizes = _compute_sp_num_tokens(self.num_tokens_across_dp_cpu, sequence_parallel_size)
        yield from _impl.holding_local_sizes(self, sizes)

    def get_chunk_sizes_across_dp_rank(self) -> list[int] | None:
        """The current chunk's per-rank sizes; only valid inside a sizes context.

        Raises:
            RuntimeError: called outside :meth:`chunked_sizes` / :meth:`sp_local_sizes`.
        """
        return _impl.current_local_sizes(self.local_sizes)

    def cu_tokens_across_sp(self, sp_size: int) -> torch.Tensor:
        """Cumulative token counts over the DP x sequence-parallel ranks.

        With ``sp_size == 1`` this is the running sum of the DP ranks' counts.
        """
        sp_tokens = _compute_sp_num_tokens(self.num_tokens_across_dp_cpu, sp_size)
        return torch.cumsum(torch.tensor(sp_tokens), dim=0)


@dataclass
class ForwardContext:
    """Everything a forward pass's layers may need, set for the duration of the pass.

    Attributes:
        no_compile_layers: Layers not compiled, by name (the config's
            ``static_forward_context``).
        attn_metadata: Attention metadata: one dict from layer name to metadata, or a
            list of such dicts, one per micro-batch; ``None`` for dummy runs.
        slot_mapping: KV-cache slot mapping by layer name (or a list per micro-batch).
        virtual_engine: Index of the virtual engine (pipeline stage copy) running the pass.
        dp_metadata: DP token counts when DP is on for an MoE model.
        cudagraph_runtime_mode: NONE, PIECEWISE or FULL (never a two-routine mode).
        batch_descriptor: Key of the CUDA graph to replay, if any.
        ubatch_slices: Micro-batch slices when the batch is micro-batched.
        skip_compiled: Run the model's plain ``forward`` instead of the compiled one.
        all_moe_layers: MoE layer names in call order, so custom ops need not bake names
            into compiled graphs; they take the next one at ``moe_layer_index``.
        moe_layer_index: Index of the next MoE layer name to hand out.
        additional_kwargs: Platform-specific extras.
    """

    no_compile_layers: dict[str, Any]
    attn_metadata: Any
    slot_mapping: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]
    virtual_engine: int
    dp_metadata: DPMetadata | None = None
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor | None = None
    ubatch_slices: UBatchSlices | None = None
    skip_compiled: bool = False
    all_moe_layers: list[str] | None = None
    moe_layer_index: int = 0
    additional_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _impl.check_forward_context(self, DPMetadata, BatchDescriptor)


# The current forward context of this thread / contextvars.Context (None: none set).
_forward_context_var: ContextVar[ForwardContext | None] = ContextVar(
    "vllm_bridge_forward_context", default=None
)

# The live module attributes that __getattr__ below serves, declared with their types
# (annotations only: the names stay unbound, so every read goes through __getattr__).
_forward_context: ForwardContext | None
track_batchsize: bool
batchsize_logging_interval: float
batchsize_forward_time: defaultdict[int | None, list[float]]
forward_start_time: float
last_logging_time: float


def __getattr__(name: str) -> Any:
    # Live module attributes: the current context (as vLLM's `_forward_context` global)
    # and the batch-size tracking state.
    return _impl.live_attribute(__name__, name, _forward_context_var)


def __dir__() -> list[str]:
    return sorted([*globals(), "_forward_context", *_impl.TRACKING_ATTRS])


def get_forward_context() -> ForwardContext:
    """Get the current forward context.

    Raises:
        RuntimeError: no forward context is set in this thread / session.
    """
    return _impl.current_or_raise(_forward_context_var)


def is_forward_context_available() -> bool:
    """True when a forward context is set in this thread / session."""
    return _forward_context_var.get() is not None


def create_forward_context(
    attn_metadata: Any,
    vllm_config: VllmConfig,
    virtual_engine: int = 0,
    dp_metadata: DPMetadata | None = None,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
    ubatch_slices: UBatchSlices | None = None,
    slot_mapping: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]] | None = None,
    additional_kwargs: dict[str, Any] | None = None,
    skip_compiled: bool = False,
) -> ForwardContext:
    """Build a ForwardContext (without setting it) from the config and this pass's values.

    ``no_compile_layers`` and ``all_moe_layers`` come from
    ``vllm_config.compilation_config``; ``slot_mapping`` and ``additional_kwargs`` default
    to empty dicts.

    Raises:
        TypeError / ValueError: a bad argument, including a runtime mode other than NONE,
            PIECEWISE or FULL.
    """
    return _impl.new_context(
        ForwardContext, attn_metadata, vllm_config, virtual_engine, dp_metadata,
        cudagraph_runtime_mode, batch_descriptor, ubatch_slices, slot_mapping,
        additional_kwargs, skip_compiled,
    )


@contextmanager
def override_forward_context(forward_context: ForwardContext | None) -> Iterator[None]:
    """A context manager that overrides the current forward context.

    This is used to override the forward context for a specific forward pass. ``None``
    clears it. The previous context comes back on exit, also when the body raises.
    """
    check_instance("forward_context", forward_context, ForwardContext, optional=True)
    yield from _impl.holding(_forward_context_var, forward_context)


def _make_dp_metadata(
    vllm_config: VllmConfig,
    num_tokens: int | None,
    num_tokens_across_dp: torch.Tensor | list[int] | None,
    ubatch_slices: UBatchSlices | None,
) -> DPMetadata:
    """DP metadata for this pass, running the DP coordination when counts are not given."""
    counts = _impl.coordinated_counts(vllm_config, num_tokens, num_tokens_across_dp, ubatch_slices)
    return DPMetadata.make(vllm_config.parallel_config, num_tokens or 0, counts)


@contextmanager
def set_forward_context(
    attn_metadata: Any,
    vllm_config: VllmConfig,
    virtual_engine: int = 0,
    num_tokens: int | None = None,
    num_tokens_across_dp: torch.Tensor | list[int] | None = None,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
    ubatch_slices: UBatchSlices | None = None,
    slot_mapping: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]] | None = None,
    skip_compiled: bool = False,
) -> Iterator[None]:
    """A context manager that stores the current forward context,
    can be attention metadata, etc.
    Here we can inject common logic for every model forward pass.

    On entry: when DP is on (``data_parallel_size > 1``) for a model not marked non-MoE and
    the pass has attention metadata or ``num_tokens``, builds :class:`DPMetadata` from
    ``num_tokens_across_dp``, or, when that is ``None``, from one
    :func:`coordinate_batch_across_dp` round (no padding, no micro-batching; every DP rank
    must enter too). When a CUDA-graph mode is set with ``num_tokens`` and no
    ``batch_descriptor``, uses ``BatchDescriptor(num_tokens)``. Then sets the context for
    this thread / session. On exit (also on error) restores the previous context and, with
    batch-size tracking on and attention metadata given, records the pass's time.
    """
    yield from _impl.forward_pass(
        _forward_context_var, create_forward_context, _make_dp_metadata, BatchDescriptor,
        attn_metadata, vllm_config, virtual_engine, num_tokens, num_tokens_across_dp,
        cudagraph_runtime_mode, batch_descriptor, ubatch_slices, slot_mapping, skip_compiled,
    )
