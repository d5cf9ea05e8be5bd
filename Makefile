# The two commands of README.md: `make demo` and `make test`. Each runs the bootstrap
# first (idempotent: a second run takes seconds).
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: demo test bootstrap test-python test-elixir test-example bench format bindings

# The example app (a user's app with the library as a path dependency), run with this
# repository's interpreter: the app reads it from VLLM_BRIDGE_PYTHON.
EXAMPLE := examples/tiny_model
EXAMPLE_ENV := VLLM_BRIDGE_PYTHON=$(CURDIR)/.venv/bin/python

bootstrap:
	@scripts/bootstrap.sh

demo: bootstrap
	@mix vllm.demo

test: bootstrap
	@$(MAKE) --no-print-directory test-python
	@$(MAKE) --no-print-directory test-elixir
	@$(MAKE) --no-print-directory test-example

# Each suite announces itself ("== suite NAME"): .ci/run checks every suite's counts.
test-python:
	@echo "== suite python"
	$(PY) -m pytest -q

test-elixir:
	@echo "== suite elixir"
	MIX_ENV=test mix test --warnings-as-errors

# The example's Python tests, then its ExUnit suite (real workers, and a release built and
# run: `mix test --exclude release` there skips that part), then whether its committed
# bindings are what the task generates now.
test-example:
	@echo "== suite example-python"
	cd $(EXAMPLE) && $(EXAMPLE_ENV) $(CURDIR)/$(PY) -m pytest -q
	@echo "== suite example-elixir"
	cd $(EXAMPLE) && $(EXAMPLE_ENV) MIX_ENV=test mix test --warnings-as-errors
	cd $(EXAMPLE) && $(EXAMPLE_ENV) MIX_ENV=test mix py.bindings --check

bench: bootstrap
	@mix vllm.bench

format:
	mix format

# Regenerate the Elixir bindings (lib/vllm/, demo/lib/vllm/, priv/bindings/) from the Python modules.
bindings: bootstrap
	mix vllm.gen.bindings
