"""The generic bridge: the Python side of the Erlang port, knowing nothing of vLLM.

* :mod:`vllm_bridge.bridge.worker`: the worker process (``python -m
  vllm_bridge.bridge.worker``), its call rule and allow-list guard, sessions and cancel;
* :mod:`vllm_bridge.bridge.protocol`: framing, the msgpack codec and its extension types
  (docs/PROTOCOL.md);
* :mod:`vllm_bridge.bridge.introspect`: what the binding generator reads of a module;
* :mod:`vllm_bridge.bridge.diag`: small functions to exercise the bridge (echo, add,
  streams, logging).

Nothing here imports the forward-context system or the demo (python/tests/
test_import_graph.py checks it): the modules a worker may call are named by its
allow-list, as strings, and imported only by the worker when it starts. This package
imports nothing itself.
"""
