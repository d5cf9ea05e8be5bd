#!/usr/bin/env bash
# Throwaway check of the lifetime rule the shared-memory design relies on (issue 19,
# part 3; bench/results/shared-memory.md, "Shared memory for large tensors"): a directory
# on /dev/shm whose owner is a BEAM is removed when that BEAM is killed with SIGKILL, by a
# keeper process (`/bin/sh`: `cat` until its stdin, a pipe from the BEAM, reaches EOF, then
# `rm -rf`), even though nothing of the BEAM runs any more. Run from anywhere:
#
#   bench/shm_proto/keeper_check.sh
set -euo pipefail
dir=/dev/shm/vllm_bridge-keeper-check-$$
elixir -e "
  dir = \"$dir\"
  File.mkdir_p!(dir); File.chmod!(dir, 0o700)
  File.write!(Path.join(dir, \"e-slot\"), :binary.copy(<<1>>, 1_048_576))
  Port.open({:spawn_executable, \"/bin/sh\"},
    [{:args, [\"-c\", \"cat >/dev/null; rm -rf -- \\\"\$0\\\"\", dir]}, :binary])
  IO.puts(\"ready\")
  Process.sleep(:infinity)
" >/tmp/keeper-check-$$.out 2>&1 &
beam=$!
for _ in $(seq 100); do grep -q ready /tmp/keeper-check-$$.out 2>/dev/null && break; sleep 0.1; done
ls "$dir" >/dev/null
echo "before: $(ls "$dir" | wc -l) file(s) in $dir; kill -9 of the BEAM (os pid $beam)"
# `elixir` execs erl; the BEAM is this pid or its child beam.smp
beam_pid=$(pgrep -P "$beam" beam.smp || echo "$beam")
t0=$(date +%s%N)
kill -9 "$beam_pid"
wait "$beam" 2>/dev/null || true
for _ in $(seq 50); do [ -e "$dir" ] || break; sleep 0.1; done
if [ -e "$dir" ]; then echo "FAIL: $dir still there"; rm -rf "$dir"; exit 1; fi
echo "after: $dir is gone, $(( ($(date +%s%N) - t0) / 1000000 )) ms after the kill"
rm -f /tmp/keeper-check-$$.out
