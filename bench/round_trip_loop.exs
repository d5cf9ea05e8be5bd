# A simple round-trip loop: `diag.add(1, 2)` through `VllmBridge.call` on a pool of one
# worker, one caller; prints p50 and p99 over `calls` (after 1 000 warm-up calls).
#
#   mix run bench/round_trip_loop.exs [calls] [rounds]
#
# To compare two trees in one run (bench/results/telemetry-and-status.md, "Status and
# logs"), run it in each tree in turn with the same interpreter; BENCH_PYTHONPATH puts
# that tree's python/ first on the worker's PYTHONPATH (so each tree's worker code runs).
{calls, rounds} =
  case System.argv() do
    [c, r] -> {String.to_integer(c), String.to_integer(r)}
    [c] -> {String.to_integer(c), 3}
    [] -> {5_000, 3}
  end

env =
  case System.get_env("BENCH_PYTHONPATH") do
    nil -> []
    dir -> [{"PYTHONPATH", dir}]
  end

{:ok, _} = VllmBridge.start_pool(:round_trip_loop, size: 1, worker_env: env)

call = fn ->
  {:ok, 3} =
    VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [1, 2], %{}, pool_name: :round_trip_loop)
end

for _ <- 1..1_000, do: call.()

for round <- 1..rounds do
  times =
    for _ <- 1..calls do
      t0 = System.monotonic_time()
      call.()
      System.monotonic_time() - t0
    end
    |> Enum.map(&System.convert_time_unit(&1, :native, :nanosecond))
    |> Enum.sort()

  p = fn q -> Enum.at(times, min(round(q * calls), calls - 1)) / 1000 end

  IO.puts(
    "round #{round}: #{calls} calls, p50 #{Float.round(p.(0.5), 1)} us, p99 #{Float.round(p.(0.99), 1)} us"
  )
end

VllmBridge.stop_pool(:round_trip_loop)
