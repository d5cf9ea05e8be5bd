# The two commands of README.md: `make demo` and `make test`. Each runs the bootstrap
# first (idempotent: a second run takes seconds).
SHELL := /bin/bash
PY := .venv/bin/python

.PHONY: demo test bootstrap test-python test-elixir bench format bindings

bootstrap:
	@scripts/bootstrap.sh

demo: bootstrap
	@mix vllm.demo

test: bootstrap
	@$(MAKE) --no-print-directory test-python
	@$(MAKE) --no-print-directory test-elixir

test-python:
	$(PY) -m pytest -q

test-elixir:
	MIX_ENV=test mix test --warnings-as-errors

bench: bootstrap
	@mix vllm.bench

format:
	mix format

# Regenerate the Elixir bindings (lib/vllm/, demo/lib/vllm/, priv/bindings/) from the Python modules.
bindings: bootstrap
	mix vllm.gen.bindings
