# Part 9's small-call figures alone (issue 19; bench/results/erlport-round-trip.md, "What
# changed, measured"): the trivial call through the whole stack beside erlport's
# :python.call of the same function and the raw echo, in alternating rounds
# (VllmBridge.Bench.Erlport.run/3 without its binary echoes): p50 and p99 with one caller,
# calls/s with 64 callers over a pool of 2 workers (max_in_flight 32) and 2 erlport
# processes, best of 2 rounds. A quicker A/B than `mix vllm.bench`: run it in two builds
# in turn. The p50 is also measured with every subject on one CPU (`one_cpu`) and with
# the BEAM on CPU 0 and the Python processes on CPU 1 (`apart`), where taskset can pin
# (bench/results/erlport-placement.md).
#
#   ERLPORT_DIR=/tmp/erlport mix run bench/small_call.exs [calls rounds duration_ms]
#
# (defaults 10 000 calls in 10 rounds, 3 000 ms per throughput round)

alias VllmBridge.Bench.{Erlport, Stats}

[calls, rounds, duration] =
  case System.argv() do
    [] -> [10_000, 10, 3_000]
    [c, r, d] -> Enum.map([c, r, d], &String.to_integer/1)
  end

case Erlport.find() do
  {:skip, why} ->
    IO.puts("skipped: #{why}")

  {:ok, _} ->
    python = Application.fetch_env!(:vllm_bridge, :python)
    {:ok, _} = VllmBridge.start_pool(:small_call, size: 2, max_in_flight: 32)

    r =
      Erlport.run(:small_call, python,
        calls: calls,
        rounds: rounds,
        duration_ms: duration,
        sizes_mib: []
      )

    l = r.latency
    p = fn s, q -> Stats.fmt(Stats.percentile(s, q)) end
    ratio = Stats.percentile(l.full, 50) / Stats.percentile(l.erlport, 50)

    IO.puts(
      "p50 full/erlport/raw: #{p.(l.full, 50)} / #{p.(l.erlport, 50)} / #{p.(l.raw, 50)} us" <>
        "  ratio full/erlport #{Float.round(ratio, 2)}"
    )

    IO.puts(
      "p99 full/erlport/raw: #{p.(l.full, 99)} / #{p.(l.erlport, 99)} / #{p.(l.raw, 99)} us"
    )

    # The same in the placements set for every subject alike (where taskset can pin).
    case l.placed do
      {:skip, why} ->
        IO.puts("set placements skipped: #{why}")

      placed ->
        for {where, pl} <- placed do
          r = Stats.percentile(pl.full, 50) / Stats.percentile(pl.erlport, 50)

          IO.puts(
            "#{where}: p50 full/erlport/raw: #{p.(pl.full, 50)} / #{p.(pl.erlport, 50)} / " <>
              "#{p.(pl.raw, 50)} us  ratio full/erlport #{Float.round(r, 2)}"
          )
        end
    end

    t = r.throughput

    IO.puts(
      "throughput full/erlport/raw: #{round(t.full)} / #{round(t.erlport)} / #{round(t.raw)} " <>
        "calls/s  ratio full/erlport #{Float.round(t.full / t.erlport, 2)}"
    )

    VllmBridge.stop_pool(:small_call)
end
