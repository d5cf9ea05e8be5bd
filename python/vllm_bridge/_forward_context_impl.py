"""The bodies behind :mod:`vllm_bridge.forward_context`: checks, counts, context managers.

Private to the forward-context system. What callers call and the bindings name stays
defined in ``forward_context`` (a function's or class's ``__module__`` is what the worker's
call rule checks, and a dataclass's is its name on the wire); the checks and computations
its classes and functions run live here, and the names of the batch-size tracking
attributes it serves live. This module never imports ``forward_context`` (no import
circle): the classes a body needs are passed in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from vllm_bridge import batchsize as _batchsize
from vllm_bridge._checks import (
    as_count_tensor,
    check_bool,
    check_instance,
    check_int,
    check_list_of,
    check_optional_int,
    is_count_tensor,
)
from vllm_bridge.config import ParallelConfig, VllmConfig
from vllm_bridge.cudagraph import RUNTIME_MODES, CUDAGraphMode, cudagraph_mode_from
from vllm_bridge.dp import coordinate_batch_across_dp
from vllm_bridge.platforms import current_platform
from vllm_bridge.ubatch import UBatchSlice, UBatchSlices


#: Batch-size tracking state that forward_context serves as live module attributes, read
#: from vllm_bridge.batchsize.
TRACKING_ATTRS = (
    "track_batchsize",
    "batchsize_logging_interval",
    "batchsize_forward_time",
    "forward_start_time",
    "last_logging_time",
)


def live_attribute(module: str, name: str, var: ContextVar[Any]) -> Any:
    """A live module attribute of forward_context (its ``__getattr__``): the current
    context (as vLLM's ``_forward_context`` global) and the batch-size tracking state."""
    if name == "_forward_context":
        return var.get()
    if name in TRACKING_ATTRS:
        return getattr(_batchsize, name)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def current_or_raise(var: ContextVar[Any]) -> Any:
    context = var.get()
    if context is None:
        raise RuntimeError(
            "Forward context is not set. "
            "Please use `set_forward_context` to set the forward context."
        )
    return context


def logger_named(name: Any) -> logging.Logger:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {name!r}")
    return logging.getLogger(name)


def check_batch_descriptor(d: Any) -> None:
    """The field checks of a ``BatchDescriptor`` (``d``), naming the bad field."""
    reqs, loras = d.num_reqs, d.num_active_loras
    if (  # the common, valid case in exact-type tests; the checks below name errors
        type(d.num_tokens) is int
        and d.num_tokens >= 0
        and (reqs is None or (type(reqs) is int and reqs >= 0))
        and type(d.uniform) is bool
        and type(d.has_lora) is bool
        and type(loras) is int
        and loras >= 0
    ):
        return
    check_int("BatchDescriptor.num_tokens", d.num_tokens, minimum=0)
    check_optional_int("BatchDescriptor.num_reqs", d.num_reqs, minimum=0)
    check_bool("BatchDescriptor.uniform", d.uniform)
    check_bool("BatchDescriptor.has_lora", d.has_lora)
    check_int("BatchDescriptor.num_active_loras", d.num_active_loras, minimum=0)


def sp_num_tokens(
    num_tokens_across_dp_cpu: torch.Tensor | list[int], sequence_parallel_size: int
) -> list[int]:
    """Each DP rank's count ceil-divided over ``sequence_parallel_size`` ranks."""
    counts = as_count_tensor("num_tokens_across_dp_cpu", num_tokens_across_dp_cpu)
    check_int("sequence_parallel_size", sequence_parallel_size, minimum=1)
    per_sp = (counts + sequence_parallel_size - 1) // sequence_parallel_size
    return per_sp.repeat_interleave(sequence_parallel_size).tolist()


def chunked_local_num_tokens(
    num_tokens_across_dp_cpu: torch.Tensor | list[int],
    sequence_parallel_size: int,
    max_num_tokens: int,
    chunk_idx: int,
) -> list[int]:
    """Chunk ``chunk_idx``'s count on each sequence-parallel rank, never below 1."""
    check_int("max_num_tokens", max_num_tokens, minimum=1)
    check_int("chunk_idx", chunk_idx, minimum=0)
    sp_tokens = sp_num_tokens(num_tokens_across_dp_cpu, sequence_parallel_size)
    consumed = max_num_tokens * chunk_idx
    return [max(1, min(max_num_tokens, tokens - consumed)) for tokens in sp_tokens]


def check_dp_metadata(metadata: Any) -> None:
    """The field checks of a ``DPMetadata`` (``metadata``)."""
    counts, most = metadata.num_tokens_across_dp_cpu, metadata.max_tokens_across_dp_cpu
    local_sizes = metadata.local_sizes
    if not is_count_tensor(counts):
        raise TypeError(
            f"num_tokens_across_dp_cpu must be a 1-D integer tensor, got {counts!r:.100}"
        )
    if not isinstance(most, torch.Tensor) or most.numel() != 1:
        raise TypeError(
            f"max_tokens_across_dp_cpu must be a one-element tensor, got {most!r:.100}"
        )
    if local_sizes is not None:
        check_list_of("local_sizes", local_sizes, int)


def dp_counts(
    parallel_config: ParallelConfig,
    num_tokens: int,
    num_tokens_across_dp_cpu: torch.Tensor | list[int],
) -> torch.Tensor:
    """Every rank's counts, checked against the config and this rank's ``num_tokens``
    (what ``DPMetadata.make`` builds from)."""
    check_instance("parallel_config", parallel_config, ParallelConfig)
    check_int("num_tokens", num_tokens, minimum=0)
    if num_tokens_across_dp_cpu is None:
        raise ValueError("num_tokens_across_dp_cpu is required, got None")
    if parallel_config.data_parallel_size <= 1:
        raise ValueError(
            "DPMetadata needs data_parallel_size > 1, "
            f"got {parallel_config.data_parallel_size}"
        )
    if parallel_config.is_moe_model is False:
        raise ValueError("DPMetadata is only built for MoE models; is_moe_model is False")
    counts = as_count_tensor("num_tokens_across_dp_cpu", num_tokens_across_dp_cpu)
    dp_size = parallel_config.data_parallel_size
    dp_rank = parallel_config.data_parallel_rank
    values = counts.tolist()
    if len(values) != dp_size:
        raise ValueError(
            f"num_tokens_across_dp_cpu has {len(values)} entries "
            f"({values}) but data_parallel_size is {dp_size}"
        )
    if values[dp_rank] != num_tokens:
        raise ValueError(
            f"num_tokens_across_dp_cpu[{dp_rank}] is {values[dp_rank]} "
            f"but this rank's num_tokens is {num_tokens}"
        )
    return counts


def check_forward_context(
    ctx: Any, dp_metadata_type: type, batch_descriptor_type: type
) -> None:
    """The field checks of a ``ForwardContext`` (``ctx``); turns an atom or name given as
    the runtime mode into its :class:`CUDAGraphMode` member, in place."""
    mode = ctx.cudagraph_runtime_mode
    if mode.__class__ is not CUDAGraphMode:
        mode = ctx.cudagraph_runtime_mode = cudagraph_mode_from(mode, "cudagraph_runtime_mode")
    if mode not in RUNTIME_MODES:
        raise ValueError(
            f"Invalid cudagraph runtime mode: {mode.name}; a forward pass runs under "
            "NONE, PIECEWISE or FULL"
        )
    check_instance("no_compile_layers", ctx.no_compile_layers, dict)
    # Cheap exact-type tests first (this runs on every forward pass); the full check
    # only runs to raise the error.
    if type(ctx.virtual_engine) is not int or ctx.virtual_engine < 0:
        check_int("virtual_engine", ctx.virtual_engine, minimum=0)
    check_instance("dp_metadata", ctx.dp_metadata, dp_metadata_type, optional=True)
    check_instance("batch_descriptor", ctx.batch_descriptor, batch_descriptor_type, optional=True)
    check_list_of("ubatch_slices", ctx.ubatch_slices, UBatchSlice, optional=True)
    if type(ctx.skip_compiled) is not bool:
        check_bool("skip_compiled", ctx.skip_compiled)
    if type(ctx.moe_layer_index) is not int or ctx.moe_layer_index < 0:
        check_int("moe_layer_index", ctx.moe_layer_index, minimum=0)
    check_instance("additional_kwargs", ctx.additional_kwargs, dict)
    slots = ctx.slot_mapping
    if type(slots) is not dict and not (
        isinstance(slots, list) and all(isinstance(m, dict) for m in slots)
    ):
        raise TypeError(
            "slot_mapping must be a dict (layer name -> tensor) or a list of them, one "
            f"per micro-batch, got {slots!r:.100}"
        )
    if ctx.all_moe_layers is not None:
        check_list_of("all_moe_layers", ctx.all_moe_layers, str)


def coordinated_counts(
    vllm_config: VllmConfig,
    num_tokens: int | None,
    num_tokens_across_dp: torch.Tensor | list[int] | None,
    ubatch_slices: UBatchSlices | None,
) -> torch.Tensor | list[int]:
    """The DP counts of a pass: as given, or from one :func:`coordinate_batch_across_dp`
    round when not given (DP padding and micro-batching are both off in this path)."""
    if num_tokens_across_dp is not None:
        return num_tokens_across_dp
    if ubatch_slices is not None:
        raise ValueError(
            "ubatch_slices needs num_tokens_across_dp (from coordinate_batch_across_dp)"
        )
    if num_tokens is None:
        raise ValueError("num_tokens is required when DP is on and num_tokens_across_dp is None")
    _, counts, _ = coordinate_batch_across_dp(
        num_tokens_unpadded=num_tokens,
        allow_microbatching=False,
        allow_dp_padding=False,
        parallel_config=vllm_config.parallel_config,
    )
    return counts


def new_context(
    context_type: type,
    attn_metadata: Any,
    vllm_config: Any,
    virtual_engine: int,
    dp_metadata: Any,
    mode: Any,
    batch_descriptor: Any,
    ubatch_slices: Any,
    slot_mapping: Any,
    additional_kwargs: dict[str, Any] | None,
    skip_compiled: bool,
) -> Any:
    """The body of ``create_forward_context`` (which documents it); ``context_type`` is
    ``ForwardContext``."""
    check_instance("vllm_config", vllm_config, VllmConfig)
    compilation = vllm_config.compilation_config
    return context_type(
        no_compile_layers=compilation.static_forward_context,
        attn_metadata=attn_metadata,
        slot_mapping=slot_mapping if slot_mapping is not None else {},
        virtual_engine=virtual_engine,
        dp_metadata=dp_metadata,
        cudagraph_runtime_mode=mode,
        batch_descriptor=batch_descriptor,
        ubatch_slices=ubatch_slices,
        skip_compiled=skip_compiled,
        all_moe_layers=compilation.static_all_moe_layers,
        additional_kwargs=additional_kwargs if additional_kwargs is not None else {},
    )


def check_set_arguments(vllm_config: Any, num_tokens: Any, mode: Any) -> CUDAGraphMode:
    """``set_forward_context``'s argument checks; returns the runtime mode as a member."""
    check_instance("vllm_config", vllm_config, VllmConfig)
    if num_tokens is not None and (type(num_tokens) is not int or num_tokens < 0):
        check_optional_int("num_tokens", num_tokens, minimum=0)
    if mode.__class__ is not CUDAGraphMode:
        mode = cudagraph_mode_from(mode, "cudagraph_runtime_mode")
    return mode


def needs_dp_metadata(
    parallel_config: ParallelConfig, attn_metadata: Any, num_tokens: int | None
) -> bool:
    """DP is on for a model not marked non-MoE, and the pass has tokens to count."""
    return (
        parallel_config.data_parallel_size > 1
        and parallel_config.is_moe_model is not False
        and (attn_metadata is not None or num_tokens is not None)
    )


# -- bodies of the context managers -----------------------------------------------------


def holding_local_sizes(metadata: Any, sizes: list[int]) -> Iterator[list[int]]:
    """``metadata.local_sizes`` is ``sizes`` while the caller's ``with`` body runs."""
    metadata.local_sizes = sizes
    try:
        yield sizes
    finally:
        metadata.local_sizes = None


def current_local_sizes(local_sizes: list[int] | None) -> list[int]:
    if local_sizes is None:
        raise RuntimeError(
            "local_sizes is only set inside DPMetadata.chunked_sizes(...) or "
            "DPMetadata.sp_local_sizes(...)"
        )
    return local_sizes


def holding(var: ContextVar[Any], value: Any) -> Iterator[None]:
    """``var`` is ``value`` while the caller's ``with`` body runs; then what it was."""
    previous = var.get()
    var.set(value)
    try:
        yield
    finally:
        var.set(previous)


def forward_pass(
    var: ContextVar[Any],
    make_context: Callable[..., Any],
    make_dp_metadata: Callable[..., Any],
    make_descriptor: Callable[..., Any],
    attn_metadata: Any,
    vllm_config: VllmConfig,
    virtual_engine: int,
    num_tokens: int | None,
    num_tokens_across_dp: torch.Tensor | list[int] | None,
    mode: CUDAGraphMode,
    batch_descriptor: Any,
    ubatch_slices: UBatchSlices | None,
    slot_mapping: Any,
    skip_compiled: bool,
) -> Iterator[None]:
    """The body of ``set_forward_context`` (which documents it); ``make_context``,
    ``make_dp_metadata`` and ``make_descriptor`` are ``create_forward_context``,
    ``_make_dp_metadata`` and ``BatchDescriptor``."""
    mode = check_set_arguments(vllm_config, num_tokens, mode)
    tracking = _batchsize.track_batchsize and attn_metadata is not None
    start = _batchsize.begin() if tracking else 0.0

    dp_metadata = None
    if needs_dp_metadata(vllm_config.parallel_config, attn_metadata, num_tokens):
        dp_metadata = make_dp_metadata(
            vllm_config, num_tokens, num_tokens_across_dp, ubatch_slices
        )

    # No harm in a default descriptor: a wrapper without a matching graph falls through.
    if mode is not CUDAGraphMode.NONE and num_tokens is not None:
        batch_descriptor = batch_descriptor or make_descriptor(num_tokens=num_tokens)

    additional_kwargs = current_platform.set_additional_forward_context(
        attn_metadata=attn_metadata,
        vllm_config=vllm_config,
        virtual_engine=virtual_engine,
        dp_metadata=dp_metadata,
        num_tokens=num_tokens,
        num_tokens_across_dp=num_tokens_across_dp,
        cudagraph_runtime_mode=mode,
        batch_descriptor=batch_descriptor,
        ubatch_slices=ubatch_slices,
    )
    context = make_context(
        attn_metadata,
        vllm_config,
        virtual_engine,
        dp_metadata,
        mode,
        batch_descriptor,
        ubatch_slices,
        slot_mapping,
        additional_kwargs,
        skip_compiled,
    )
    previous = var.get()
    var.set(context)
    try:
        yield
    finally:
        var.set(previous)
        if tracking:
            _batchsize.end(num_tokens, start)
