#!/usr/bin/env bash
# What the map-key, depth and id checks of the codec cost, old against new in one run:
# the codec of BASE (default 807b8d1, before the checks) is loaded beside the current one
# under other module names, and both encode (Elixir) / decode (Python) the same requests
# in interleaved rounds (medians of 7). Usage: bench/codec_checks/run.sh [BASE]
set -euo pipefail
cd "$(dirname "$0")/../.."
base=${1:-807b8d1}
old=$(mktemp -d)
trap 'rm -rf "$old"' EXIT
git show "$base:python/vllm_bridge/protocol/decoder.py" >"$old/old_decoder.py"
# The base's decoder imports its siblings from where they were then (vllm_bridge.protocol,
# before the bridge became its own subpackage): today's, unchanged since in what it uses.
sed -i 's/vllm_bridge\.protocol\./vllm_bridge.bridge.protocol./' "$old/old_decoder.py"
for f in codec.ex codec/msgpack.ex codec/ext.ex codec/dataclass.ex wire.ex; do
  git show "$base:lib/vllm_bridge/$f" >"$old/old_$(basename "$f")"
done
# The old modules under the names Old.*, so that both sets load in one VM.
sed -i 's/defmodule VllmBridge.Codec.Msgpack do/defmodule Old.Msgpack do/' "$old/old_msgpack.ex"
sed -i -e 's/defmodule VllmBridge.Codec.Ext do/defmodule Old.Ext do/' \
  -e 's/@behaviour VllmBridge.Codec.Msgpack/@behaviour Old.Msgpack/' \
  -e 's/alias VllmBridge.Codec.{Dataclass, Msgpack, TensorExt}/alias VllmBridge.Codec.TensorExt\n  alias Old.{Dataclass, Msgpack}/' \
  "$old/old_ext.ex"
sed -i -e 's/defmodule VllmBridge.Codec.Dataclass do/defmodule Old.Dataclass do/' \
  -e 's/alias VllmBridge.Codec.{Msgpack, Registry}/alias VllmBridge.Codec.Registry\n  alias Old.Msgpack/' \
  "$old/old_dataclass.ex"
sed -i -e 's/defmodule VllmBridge.Codec do/defmodule Old.Codec do/' \
  -e 's/alias VllmBridge.Codec.{Ext, Msgpack}/alias Old.{Ext, Msgpack}/' "$old/old_codec.ex"
sed -i -e 's/defmodule VllmBridge.Wire do/defmodule Old.Wire do/' \
  -e 's/alias VllmBridge.{Codec, Error, Ref}/alias VllmBridge.{Error, Ref}\n  alias Old.Codec/' \
  "$old/old_wire.ex"
echo "== Python: Decoder.decode of a request (us per frame, old / new)"
.venv/bin/python bench/codec_checks/decode_ab.py "$old"
echo "== Elixir: Wire.encode_invoke of a request (us per call, old / new)"
OLD_DIR="$old" mix run --no-start bench/codec_checks/encode_ab.exs 2>&1 | grep " us "
