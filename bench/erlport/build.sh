#!/usr/bin/env bash
# Builds erlport (the peer of bench part 8) from its public source with erlc, outside
# this repository. The project never depends on it: only `mix vllm.bench` looks for it,
# through ERLPORT_DIR.
#
#   bench/erlport/build.sh SRC DEST
#
# SRC:  a checkout of https://github.com/erlport/erlport (v0.11.0 was measured: commit
#       d01e1dc), e.g. `git clone https://github.com/erlport/erlport SRC`.
# DEST: where the build goes; its last path component must be `erlport` (or
#       `erlport-<vsn>`), because erlport finds its Python half with
#       code:priv_dir(erlport), which looks the application up by its directory's name.
#       Then `export ERLPORT_DIR=DEST`.
#
# DEST gets ebin/ (the compiled modules and erlport.app) and priv/python3/ (erlport's
# Python half, pure Python, used as it is).
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 SRC DEST" >&2
  exit 2
fi
src=$1
dest=$2

for f in src/python.erl src/erlport.erl src/erlport.app.src priv/python3/erlport/erlang.py; do
  if [ ! -f "$src/$f" ]; then
    echo "$0: $src does not look like an erlport source tree ($f missing)" >&2
    exit 1
  fi
done
case "$(basename "$dest")" in
  erlport | erlport-*) ;;
  *)
    echo "$0: DEST must be named erlport or erlport-<vsn> (code:priv_dir(erlport) finds it by name): $dest" >&2
    exit 1
    ;;
esac

mkdir -p "$dest/ebin" "$dest/priv"
erlc -o "$dest/ebin" -I "$src/src" "$src"/src/*.erl
# The .app file with its module list filled in, as rebar would write it.
modules=$(cd "$dest/ebin" && ls *.beam | sed 's/\.beam$//' | paste -sd, -)
sed "s/{modules,\[\]}/{modules,[$modules]}/" "$src/src/erlport.app.src" >"$dest/ebin/erlport.app"
rm -rf "$dest/priv/python3"
cp -R "$src/priv/python3" "$dest/priv/python3"
rm -rf "$dest/priv/python3/erlport/tests"
echo "built erlport into $dest; export ERLPORT_DIR=$(cd "$dest" && pwd)"
