"""The demo: a small mixture-of-experts model run the way vLLM runs one.

* :mod:`vllm_bridge.demo.model`: the model, whose layers read the forward context;
* :mod:`vllm_bridge.demo.batch`: the persistent input batch and the scheduler's steps;
* :mod:`vllm_bridge.demo.model_runner`: vLLM's model runner (one per rank: prepare the
  batch, coordinate across DP, dispatch CUDA graphs, run the model);
* :mod:`vllm_bridge.demo.rank`: the per-rank entry points the Elixir side calls
  (``Vllm.Demo.Rank.Module``, ``mix vllm.demo``).

It is built on the forward-context system (``vllm_bridge.forward_context``, ``.dp``, ...),
which knows nothing of it. This package imports nothing itself.
"""
