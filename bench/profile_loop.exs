# One caller's trivial call in a loop, for a sampled profile of the whole round trip with
# `perf` (issue 19; bench/results/erlport-placement.md, "A sampled profile"): the whole
# stack (`full`) or erlport's :python.call of the same function (`erlport`), for `secs`
# seconds after 2 000 warm-up calls. It writes `ready_file` when the warm-up is done, so
# that the profiler starts on the loop only, and prints the mean time a call.
#
#   ELIXIR_ERL_OPTIONS="+JPperf true +sbwt none +sbwtdcpu none +sbwtdio none" \
#     ERLPORT_DIR=/tmp/erlport taskset -c 0 mix run bench/profile_loop.exs full|erlport SECS READY_FILE &
#   # once READY_FILE exists:
#   perf record -e cpu-clock -F 2000 -a -C 0 -o full.data -- sleep 10
#   perf report -i full.data --no-children --sort comm,dso --stdio
#
# `+JPperf true` names the JIT's code (Elixir and Erlang functions) in the profile;
# `taskset -c 0` puts the BEAM and the Python processes it starts on one CPU, where the
# profile's shares are each side's work a call (bench/one_caller.exs's `pin`).

alias VllmBridge.Bench.{Erlport, Stats, Trivial}

{which, secs, ready} =
  case System.argv() do
    [w, s, r] when w in ["full", "erlport"] -> {w, String.to_integer(s), r}
    _ -> raise "usage: mix run bench/profile_loop.exs full|erlport SECS READY_FILE"
  end

call =
  case which do
    "full" ->
      {:ok, _} = VllmBridge.start_pool(:profile_loop, size: 1)
      fn -> Stats.check!(Trivial.call(pool_name: :profile_loop)) end

    "erlport" ->
      case Erlport.find() do
        {:ok, _} -> :ok
        {:skip, why} -> raise "erlport: #{why}"
      end

      peer = Erlport.start_peer(Application.fetch_env!(:vllm_bridge, :python))
      fn -> Stats.check!({:ok, Erlport.call_peer(peer)}) end
  end

for _ <- 1..2_000, do: call.()
File.write!(ready, "ready\n")
stop = System.monotonic_time(:millisecond) + secs * 1_000

loop = fn loop, n ->
  if System.monotonic_time(:millisecond) < stop do
    for _ <- 1..100, do: call.()
    loop.(loop, n + 100)
  else
    n
  end
end

n = loop.(loop, 0)
IO.puts("#{which}: #{n} calls in #{secs} s, #{Stats.fmt(secs * 1.0e6 / n, 2)} us a call")
