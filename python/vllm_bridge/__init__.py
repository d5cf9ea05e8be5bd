"""vllm_bridge: vLLM's forward-context system on PyTorch, served to Elixir over Erlang ports.

Three parts, each depending only on the ones before it:

* :mod:`vllm_bridge.bridge` - the generic bridge (the worker process, the wire protocol,
  introspection for the binding generator); it knows nothing of vLLM;
* the forward-context system, at this level: :mod:`~vllm_bridge.forward_context`,
  :mod:`~vllm_bridge.dp`, :mod:`~vllm_bridge.cudagraph`,
  :mod:`~vllm_bridge.cudagraph_dispatch`, :mod:`~vllm_bridge.ubatch`,
  :mod:`~vllm_bridge.batchsize`, :mod:`~vllm_bridge.config`,
  :mod:`~vllm_bridge.platforms` (their import names are the bindings' names);
* :mod:`vllm_bridge.demo` - the demo's model and runners.

The public modules (the worker's default allow-list) are listed in
``vllm_bridge.PUBLIC_MODULES``, as plain strings: this package imports nothing, so the
bridge can read the list without loading the other parts.
"""

__version__ = "0.1.0"

#: Protocol version spoken by this package's worker (docs/PROTOCOL.md).
PROTOCOL_VERSION = 1

#: Modules a worker may call into by default. Anything else is refused by name.
#: The demo's ``vllm_bridge.demo.rank`` is not here: it writes and reads files at paths
#: its caller names (``save_weights``, ``load_model``), so only the demo's pools allow it
#: (the pool option ``modules:``, ``--also-allow``); see docs/SECURITY.md.
PUBLIC_MODULES: tuple[str, ...] = (
    "vllm_bridge.bridge.diag",
    "vllm_bridge.cudagraph",
    "vllm_bridge.config",
    "vllm_bridge.forward_context",
    "vllm_bridge.dp",
    "vllm_bridge.ubatch",
)
