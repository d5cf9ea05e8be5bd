import Config

# The pools are configured in config/runtime.exs: they need values known only when the
# app boots (the DP rendezvous port), and runtime.exs is read at boot by `mix` and by a
# release alike. The Python interpreter comes from VLLM_BRIDGE_PYTHON, read when a pool
# starts (or set `config :vllm_bridge, python: "/path/to/.venv/bin/python"`).

config :logger, level: :warning
