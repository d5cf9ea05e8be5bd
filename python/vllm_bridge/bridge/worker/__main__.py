"""Entry point: ``python -m vllm_bridge.bridge.worker``."""

from vllm_bridge.bridge.worker.server import main

if __name__ == "__main__":
    raise SystemExit(main())
