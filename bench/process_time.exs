# How long the worker process and the caller are scheduled in per call (issue 19;
# bench/results/erlport-round-trip-continued.md, "The worker process and the Python
# worker, measured"): `:erlang.trace/3` with `:running` and monotonic timestamps on both,
# summed by a tracer process, over N calls of
#
#   wproc  a request built once, sent with VllmBridge.Call.Request.call/3 straight to
#          the worker process (as bench/roundtrip_breakdown.exs);
#   full   the trivial call through the whole stack (a pool of 1).
#
#   mix run bench/process_time.exs [calls rounds]     (defaults 10 000, 5)
#
# The trace's own cost is in every figure alike (compare the two builds, not the figures
# with the round trip). A process is "in" from its schedule-in to its schedule-out: time
# the OS took its scheduler thread away (a write to the port that woke the Python worker
# on the same CPU) counts as in.

alias VllmBridge.Call.{Request, Wire}

[n, rounds] =
  case System.argv() do
    [] -> [10_000, 5]
    [c, r] -> [String.to_integer(c), String.to_integer(r)]
  end

{:ok, _} = VllmBridge.start_pool(:process_time, size: 1, max_in_flight: 32)
{:ok, [w]} = VllmBridge.Pool.workers(:process_time)
target = {"vllm_bridge.forward_context", "is_forward_context_available"}
{:ok, parts} = Wire.encode_invoke(target, [], %{})
req = Request.new("call", pre: [Wire.value(nil)], post: parts, target: target)

subjects = [
  wproc: fn -> Request.call(w.pid, req, :infinity) end,
  full: fn -> VllmBridge.Bench.Trivial.call(pool_name: :process_time) end
]

defmodule Tracer do
  # Sums each traced process's scheduled-in time (native units).
  def loop(acc) do
    receive do
      {:trace_ts, pid, :in, _, ts} ->
        loop(Map.put(acc, {:in, pid}, ts))

      {:trace_ts, pid, :out, _, ts} ->
        case acc do
          %{{:in, ^pid} => t0} -> loop(Map.update(acc, pid, ts - t0, &(&1 + ts - t0)))
          _ -> loop(acc)
        end

      {:get, from} ->
        send(from, {:acc, acc})
    end
  end
end

per_call = fn acc, pid ->
  round(:erlang.convert_time_unit(Map.get(acc, pid, 0), :native, :nanosecond) / n)
end

results =
  for _ <- 1..rounds, {name, f} <- subjects, reduce: %{} do
    acc ->
      for _ <- 1..1_000, do: f.()
      me = self()

      caller =
        spawn(fn ->
          receive do
            :go ->
              for _ <- 1..n, do: f.()
              send(me, :done)
          end
        end)

      tracer = spawn(fn -> Tracer.loop(%{}) end)
      flags = [:running, :monotonic_timestamp, {:tracer, tracer}]
      :erlang.trace(w.pid, true, flags)
      :erlang.trace(caller, true, flags)
      send(caller, :go)

      receive do
        :done -> :ok
      end

      :erlang.trace(w.pid, false, [:all])
      Process.sleep(50)
      send(tracer, {:get, self()})

      times =
        receive do
          {:acc, a} -> {per_call.(a, w.pid), per_call.(a, caller)}
        end

      Map.update(acc, name, [times], &[times | &1])
  end

for {name, l} <- Enum.sort(results) do
  ws = l |> Enum.map(&elem(&1, 0)) |> Enum.sort()
  cs = l |> Enum.map(&elem(&1, 1)) |> Enum.sort()
  IO.puts("#{name}: worker process #{inspect(ws)} ns/call, caller #{inspect(cs)} ns/call")
end

VllmBridge.stop_pool(:process_time)
