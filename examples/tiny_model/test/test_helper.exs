# `mix test` has started the app, and with it the pools of config/runtime.exs (:tiny and
# :tiny_dp), whose workers ran tiny_lm.setup (on_start) before taking a call. The tests
# share those pools, so they run one at a time (async: false). The interpreter is
# VLLM_BRIDGE_PYTHON's (`make test-example` in the repository sets it to the repo's .venv).
#
# The release test builds and runs a release (a minute or two): `mix test --exclude
# release` skips it.
ExUnit.start()
