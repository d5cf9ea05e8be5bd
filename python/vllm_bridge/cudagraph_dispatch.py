"""Which CUDA-graph mode and padded size a batch runs with, before DP coordination.

A batch of ``num_tokens`` tokens can replay a graph when the configured mode has one for
its kind of batch (uniform decode or mixed, see :class:`~vllm_bridge.cudagraph.CUDAGraphMode`)
and a capture size covers it: it is then padded to the smallest capture size at least as
large. Otherwise it runs eagerly (``NONE``) at its own size.
"""

import bisect

from vllm_bridge._checks import check_bool, check_int
from vllm_bridge.config import CompilationConfig
from vllm_bridge.cudagraph import CUDAGraphMode

__all__ = ["dispatch_cudagraph"]


def dispatch_cudagraph(
    config: CompilationConfig, num_tokens: int, uniform_decode: bool
) -> tuple[CUDAGraphMode, int]:
    """``(runtime_mode, padded_num_tokens)`` of a batch (before DP coordination).

    Args:
        config: The configured mode and capture sizes.
        num_tokens: The batch's real tokens.
        uniform_decode: Every request of the batch computes exactly one token.
    """
    if not isinstance(config, CompilationConfig):
        raise TypeError(f"config must be a CompilationConfig, got {config!r}")
    check_int("num_tokens", num_tokens, minimum=0)
    check_bool("uniform_decode", uniform_decode)
    sizes = config.cudagraph_capture_sizes
    if num_tokens == 0 or not sizes or num_tokens > sizes[-1]:
        return CUDAGraphMode.NONE, num_tokens
    configured = config.cudagraph_mode
    mode = configured.decode_mode() if uniform_decode else configured.mixed_mode()
    if mode is CUDAGraphMode.NONE:
        return CUDAGraphMode.NONE, num_tokens
    return mode, sizes[bisect.bisect_left(sizes, num_tokens)]
