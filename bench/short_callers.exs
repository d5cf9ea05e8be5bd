# What a caller's monitor costs the worker process, for long-lived callers and for
# one-process-per-call callers (bench/results/erlport-round-trip-continued.md, "The worker
# process and the Python worker, measured"): the trivial call through a pool of 2 workers
# (max_in_flight 32) by 64 concurrent loops, each loop either calling itself (`long`: one
# caller makes every call) or spawning a `Task` per call and awaiting it (`short`: a
# process per call, as a process per HTTP request; each caller dies right after its only
# call). Rounds alternate long, short, long, short ... For each round: calls/s, the
# reductions of the pool's two worker processes per call (the throughput bottleneck's
# work, monitor and :DOWN handling included), and the BEAM's CPU time per call
# (`:erlang.statistics(:runtime)`, all schedulers). Then one more round of each load with
# the two worker processes traced (`:running`, as bench/process_time.exs): their
# scheduled-in time per call (the trace's cost is in it alike for both loads and every
# build; the port write that wakes a Python worker on the same CPU counts as in). Medians
# over the rounds are printed at the end. Run it in two builds in turn for an A/B.
#
#   mix run bench/short_callers.exs [rounds duration_ms]
#
# (defaults 4 rounds of each load, 3 000 ms each)

defmodule ShortCallers do
  alias VllmBridge.Bench.{Throughput, Trivial}

  @callers 64

  # The pool's worker processes: every VllmBridge.Worker GenServer of this node (the
  # bench starts one pool), found by the initial call gen_server records.
  def workers do
    Enum.filter(Process.list(), fn pid ->
      case Process.info(pid, :dictionary) do
        {:dictionary, d} -> d[:"$initial_call"] == {VllmBridge.Worker, :init, 1}
        nil -> false
      end
    end)
  end

  def reductions(pids) do
    Enum.reduce(pids, 0, fn pid, acc ->
      {:reductions, r} = Process.info(pid, :reductions)
      acc + r
    end)
  end

  def call(:long, pool), do: Trivial.call(pool_name: pool)

  def call(:short, pool) do
    Task.async(fn -> Trivial.call(pool_name: pool) end) |> Task.await(:infinity)
  end

  # One round of `load` for `duration` ms (the loop of VllmBridge.Bench.Throughput): calls/s,
  # worker reductions per call, BEAM CPU (us) per call, and with `trace?` the workers'
  # scheduled-in time per call (us).
  def round(load, pool, workers, duration, trace? \\ false) do
    tracer = if trace?, do: start_trace(workers)
    red0 = reductions(workers)
    {cpu0, _} = :erlang.statistics(:runtime)
    {total, elapsed} = Throughput.count(fn _i -> call(load, pool) end, @callers, duration)
    {cpu1, _} = :erlang.statistics(:runtime)
    red1 = reductions(workers)
    in_ns = if trace?, do: stop_trace(tracer, workers), else: 0

    %{
      rate: total / (elapsed / 1_000_000),
      red: (red1 - red0) / total,
      cpu_us: (cpu1 - cpu0) * 1000 / total,
      in_us: in_ns / 1000 / total
    }
  end

  defp start_trace(workers) do
    tracer = spawn(fn -> trace_loop(%{}) end)
    flags = [:running, :monotonic_timestamp, {:tracer, tracer}]
    Enum.each(workers, &:erlang.trace(&1, true, flags))
    tracer
  end

  # The workers' scheduled-in time in all, ns.
  defp stop_trace(tracer, workers) do
    Enum.each(workers, &:erlang.trace(&1, false, [:all]))
    Process.sleep(100)
    send(tracer, {:get, self()})

    receive do
      {:acc, acc} ->
        native = workers |> Enum.map(&Map.get(acc, &1, 0)) |> Enum.sum()
        :erlang.convert_time_unit(native, :native, :nanosecond)
    end
  end

  defp trace_loop(acc) do
    receive do
      {:trace_ts, pid, :in, _, ts} ->
        trace_loop(Map.put(acc, {:in, pid}, ts))

      {:trace_ts, pid, :out, _, ts} ->
        case acc do
          %{{:in, ^pid} => t0} -> trace_loop(Map.update(acc, pid, ts - t0, &(&1 + ts - t0)))
          _ -> trace_loop(acc)
        end

      {:get, from} ->
        send(from, {:acc, acc})
    end
  end

  def median(xs), do: xs |> Enum.sort() |> Enum.at(div(length(xs), 2))
end

[rounds, duration] =
  case System.argv() do
    [] -> [4, 3_000]
    [r, d] -> Enum.map([r, d], &String.to_integer/1)
  end

pool = :short_callers
{:ok, _} = VllmBridge.start_pool(pool, size: 2, max_in_flight: 32)
workers = ShortCallers.workers()
2 = length(workers)

# Warm-up: both paths once, not counted.
ShortCallers.round(:long, pool, workers, 500)
ShortCallers.round(:short, pool, workers, 500)

results =
  for i <- 1..rounds, load <- [:long, :short] do
    r = ShortCallers.round(load, pool, workers, duration)

    IO.puts(
      "round #{i} #{load}: #{round(r.rate)} calls/s, worker reductions/call " <>
        "#{Float.round(r.red, 1)}, BEAM CPU/call #{Float.round(r.cpu_us, 1)} us"
    )

    {load, r}
  end

for load <- [:long, :short] do
  rs = for {^load, r} <- results, do: r
  m = fn k -> ShortCallers.median(Enum.map(rs, & &1[k])) end

  IO.puts(
    "median #{load}: #{round(m.(:rate))} calls/s, worker reductions/call " <>
      "#{Float.round(m.(:red), 1)}, BEAM CPU/call #{Float.round(m.(:cpu_us), 1)} us"
  )
end

for load <- [:long, :short] do
  r = ShortCallers.round(load, pool, workers, duration, true)

  IO.puts(
    "traced #{load}: #{round(r.rate)} calls/s, worker processes scheduled in " <>
      "#{Float.round(r.in_us, 2)} us/call"
  )
end

VllmBridge.stop_pool(pool)
