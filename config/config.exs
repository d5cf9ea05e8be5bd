import Config

# Where the Python interpreter of the worker pool lives. The bootstrap creates .venv/;
# VLLM_BRIDGE_PYTHON overrides it at run time.
config :vllm_bridge,
  python: System.get_env("VLLM_BRIDGE_PYTHON") || Path.expand("../.venv/bin/python", __DIR__)

import_config "#{config_env()}.exs"
