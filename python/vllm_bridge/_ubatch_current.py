"""The micro-batch context of the running thread (``None`` outside micro-batch threads).

A module of its own, importing nothing of the package, so that :mod:`vllm_bridge.dp` can
look it up at each collective (and tell a micro-batch abort from a failed collective)
without importing :mod:`vllm_bridge.ubatching` (which imports the forward-context system,
which imports ``dp``: that would be a circle).
"""

from contextvars import ContextVar
from typing import Any

__all__ = ["UBatchAbortedError", "current_ubatch_context", "ubatch_context_var"]


class UBatchAbortedError(RuntimeError):
    """A micro-batched run was abandoned because another thread or another DP rank failed;
    the message carries that failure."""


#: Set by each micro-batch thread for itself (a new thread starts with an empty context).
ubatch_context_var: ContextVar[Any] = ContextVar("vllm_bridge_ubatch", default=None)


def current_ubatch_context() -> Any:
    """The :class:`~vllm_bridge.ubatching.UBatchContext` this thread runs under, or ``None``."""
    return ubatch_context_var.get()
