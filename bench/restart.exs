# How long a pool worker takes to serve again after its Python process is killed, seen
# from the Elixir side: `kill -9` of the worker's OS pid, then the time until the pool
# has a worker of a new instance at that index (`VllmBridge.Pool.workers/1`) and a call
# on it answers. Split in two: until the Worker process has noticed the exit (its row is
# gone from the directory), and the rest (the new Python process up to its handshake).
#
#     mix run bench/restart.exs [runs]      # default 7; prints the medians
#
# Not part of `make bench` (each run kills a process). See bench/results/startup.md,
# "Startup".

defmodule VllmBridge.Bench.Restart do
  alias VllmBridge.Pool

  @pool :vllm_bench_restart

  def run(runs) do
    {:ok, _} = VllmBridge.start_pool(@pool, size: 1)
    :ok = Pool.await_ready(@pool, 120_000)
    {:ok, 2} = call()

    samples = for _ <- 1..runs, do: once()
    :ok = VllmBridge.stop_pool(@pool)

    IO.puts("median of #{runs} restarts (ms): kill -9 -> serving again, and its two parts")
    report("total (kill -9 -> a call on the new worker answers)", samples, & &1.total)
    report("  the worker notices the exit", samples, & &1.noticed)

    report(
      "  new Python process -> handshake -> call answered",
      samples,
      &(&1.total - &1.noticed)
    )
  end

  defp once do
    {:ok, [%{os_pid: os_pid, instance: old}]} = Pool.workers(@pool)
    t0 = System.monotonic_time(:microsecond)
    {_, 0} = System.cmd("kill", ["-9", Integer.to_string(os_pid)])

    noticed =
      wait(fn -> match?({:ok, [w]} when w == nil or w.instance != old, Pool.workers(@pool)) end)

    wait(fn -> match?({:ok, [%{instance: new}]} when new != old, Pool.workers(@pool)) end)
    {:ok, 2} = call()
    total = System.monotonic_time(:microsecond)
    %{total: (total - t0) / 1000, noticed: (noticed - t0) / 1000}
  end

  defp call,
    do: VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [1, 1], %{}, pool_name: @pool)

  # Polls every millisecond; returns the monotonic time (us) at which `fun` held.
  defp wait(fun) do
    if fun.() do
      System.monotonic_time(:microsecond)
    else
      Process.sleep(1)
      wait(fun)
    end
  end

  defp report(label, samples, get) do
    values = samples |> Enum.map(get) |> Enum.sort()
    median = Enum.at(values, div(length(values), 2))

    IO.puts(
      "  #{String.pad_trailing(label, 56)} #{:erlang.float_to_binary(median, decimals: 0)}" <>
        "  (min #{:erlang.float_to_binary(hd(values), decimals: 0)}, max " <>
        "#{:erlang.float_to_binary(List.last(values), decimals: 0)})"
    )
  end
end

runs =
  case System.argv() do
    [n] -> String.to_integer(n)
    [] -> 7
  end

VllmBridge.Bench.Restart.run(runs)
