"""The worker process: ``python -m vllm_bridge.bridge.worker`` serves one Erlang port.

:class:`CallerError` is what a context manager's ``__exit__`` receives when the Elixir
caller failed with an error the worker has no exception object for.
"""

from vllm_bridge.bridge.worker.sessions import CallerError

CallerError.__module__ = __name__  # its public name: vllm_bridge.bridge.worker.CallerError

__all__ = ["CallerError"]
