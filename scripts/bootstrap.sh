#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: Elixir/Erlang from Debian, a Python virtual
# environment with the vllm_bridge package (torch==2.13.0, msgpack, pytest), and the Elixir
# side compiled with warnings as errors. A second run skips what is done and takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
say() { printf '[bootstrap] %s\n' "$*" >&2; }

# 1. Elixir and Erlang (Debian packages) when `elixir` is missing.
if ! command -v elixir >/dev/null 2>&1; then
  say "elixir not found: installing elixir and erlang-dev from Debian"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y elixir erlang-dev
fi

# 2. Python virtual environment with the package installed (editable) and its test extra.
py=${PYTHON:-}
if [ -z "$py" ]; then
  if command -v python3.11 >/dev/null 2>&1; then py=python3.11; else py=python3; fi
fi
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $py"
  if ! "$py" -m venv .venv; then
    rm -rf .venv
    say "could not create a virtual environment with $py: it needs Python 3.10+ with its"
    say "venv module (on Debian/Ubuntu: apt-get install python3-venv), or set PYTHON=..."
    exit 1
  fi
fi
stamp=.venv/.vllm_bridge_installed
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  say "installing torch==2.13.0, msgpack and vllm_bridge[test] into .venv"
  .venv/bin/python -m pip install --quiet --upgrade pip
  # Pin torch first: the CPU wheel lies on disk; an unpinned torch would pull a CUDA build.
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[test]"
  echo "$want" >"$stamp"
fi

# 3. Elixir side, compiled with warnings as errors (both environments the commands use).
export MIX_ENV=${MIX_ENV:-dev}
say "compiling the Elixir side (MIX_ENV=$MIX_ENV)"
mix compile --warnings-as-errors >/dev/null
say "ready: $root"
