"""The worker process: ``python -m vllm_bridge.worker`` serves one Erlang port."""
