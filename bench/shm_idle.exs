# What the idle expiry of slots costs a large round trip (issue 19): a 64 MiB echo back
# to back (its argument and result slots reused), against the first one after the worker
# was idle a while. Idle waits are given as a list, run in turn in each round (the same
# run, alternating): past both expiries (2 s for argument slots, 5 s for result slots:
# both made again, their pages allocated anew: 8000), past the argument slots' only (the
# control: 3000), or past neither (1000). Per round and wait: the median of 5
# back-to-back echoes, then one after the wait, with the slots left before it.
#
#   mix run bench/shm_idle.exs [rounds] [MiB] [idle ms, comma-separated]

alias VllmBridge.Tensor

rounds = String.to_integer(Enum.at(System.argv(), 0) || "3")
mib = String.to_integer(Enum.at(System.argv(), 1) || "64")

idles =
  (Enum.at(System.argv(), 2) || "8000")
  |> String.split(",", trim: true)
  |> Enum.map(&String.to_integer/1)

{:ok, _} = VllmBridge.start_pool(:shm_idle, size: 1)
:ok = VllmBridge.Pool.await_ready(:shm_idle, 60_000)
%{path: dir} = VllmBridge.Shm.dir()
n = div(mib * 1_048_576, 4)
t = Tensor.new(:binary.copy(<<0, 0, 128, 63>>, n), :float32, [n])

echo = fn ->
  {us, {:ok, _}} =
    :timer.tc(fn ->
      VllmBridge.call({"vllm_bridge.bridge.diag", "echo"}, [t], %{},
        pool_name: :shm_idle,
        timeout: 120_000
      )
    end)

  us / 1000
end

# Slots of each kind (argument e-, result r-) in the directory, whatever their state.
left = fn prefix -> dir |> File.ls!() |> Enum.count(&String.starts_with?(&1, prefix)) end
med = fn xs -> xs |> Enum.sort() |> Enum.at(div(length(xs), 2)) end
_ = echo.()

for r <- 1..rounds, idle <- idles do
  warm = for _ <- 1..5, do: echo.()
  Process.sleep(idle)
  {args, results} = {left.("e-"), left.("r-")}
  cold = echo.()

  IO.puts(
    "round #{r}: back to back #{Float.round(med.(warm), 1)} ms " <>
      "(#{Float.round(Enum.min(warm), 1)}-#{Float.round(Enum.max(warm), 1)}), " <>
      "after #{idle} ms idle #{Float.round(cold, 1)} ms " <>
      "(slots left before it: argument #{args}, result #{results})"
  )
end

VllmBridge.stop_pool(:shm_idle)
{load, _} = System.cmd("cat", ["/proc/loadavg"])
IO.puts("#{mib} MiB, load average #{String.trim(load)}")
