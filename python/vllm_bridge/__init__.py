"""vllm_bridge: vLLM's forward-context system on PyTorch, served to Elixir over Erlang ports.

The public modules (the worker's default allow-list) are listed in
``vllm_bridge.PUBLIC_MODULES``.
"""

__version__ = "0.1.0"

#: Protocol version spoken by this package's worker (docs/PROTOCOL.md).
PROTOCOL_VERSION = 1

#: Modules a worker may call into by default. Anything else is refused by name.
PUBLIC_MODULES: tuple[str, ...] = (
    "vllm_bridge.bridge.diag",
    "vllm_bridge.cudagraph",
    "vllm_bridge.config",
    "vllm_bridge.forward_context",
    "vllm_bridge.dp",
    "vllm_bridge.ubatch",
    "vllm_bridge.demo.rank",
)
