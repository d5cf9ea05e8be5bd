# TEMPORARY: {packet, 4} against :stream-mode framing in the worker process, measured in
# the same run, interleaved (A B, B A, ...), several rounds; medians of rounds.
#   mix run bench/framing_ab.exs [rounds]
alias VllmBridge.Bench.{Stats, Trivial}
alias VllmBridge.Tensor
import Bitwise

{rounds, parts} =
  case System.argv() do
    [] -> {9, ~w(rt thr t1 t16 t64 up64 down64)}
    [r] -> {String.to_integer(r), ~w(rt thr t1 t16 t64 up64 down64)}
    [r | parts] -> {String.to_integer(r), parts}
  end

modes = [:packet, :stream]

for m <- modes do
  {:ok, _} = VllmBridge.start_pool({:ab, m}, size: 2, max_in_flight: 32, framing: m)
end

for m <- modes, do: :ok = VllmBridge.Pool.await_ready({:ab, m}, 60_000)

latency = fn pool ->
  s = Stats.time_calls(1_500, fn -> Trivial.call(pool_name: pool) end)
  %{p50: Stats.percentile(s, 50), p99: Stats.percentile(s, 99)}
end

throughput = fn pool ->
  parent = self()
  deadline = System.monotonic_time(:millisecond) + 1_000

  loop = fn loop, n ->
    if System.monotonic_time(:millisecond) >= deadline do
      n
    else
      Stats.check!(Trivial.call(pool_name: pool))
      loop.(loop, n + 1)
    end
  end

  t0 = System.monotonic_time(:millisecond)
  pids = for _ <- 1..64, do: spawn_link(fn -> send(parent, {:n, loop.(loop, 0)}) end)
  total = Enum.reduce(pids, 0, fn _, acc -> receive(do: ({:n, n} -> acc + n)) end)
  %{rate: total / ((System.monotonic_time(:millisecond) - t0) / 1000)}
end

tensor = fn mib, reps ->
  t =
    Tensor.new(:binary.copy(<<0, 0, 128, 63>>, div(mib <<< 20, 4)), :float32, [div(mib <<< 20, 4)])

  fn pool ->
    call = fn ->
      {:ok, %Tensor{}} =
        VllmBridge.call({"vllm_bridge.diag", "echo"}, [t], %{}, pool_name: pool, timeout: 300_000)

      :ok
    end

    %{ms: Stats.median(Stats.time_calls(reps, call)) / 1000}
  end
end

# One direction at a time: a 64 MiB request with a small (error) reply, and a small
# request (a `get` of the tensor an opaque object holds) with a 64 MiB reply.
big =
  Tensor.new(:binary.copy(<<0, 0, 128, 63>>, div(64 <<< 20, 4)), :float32, [div(64 <<< 20, 4)])

holders =
  Map.new(modes, fn m ->
    {:ok, ref} = VllmBridge.call({"vllm_bridge.diag", "opaque"}, [big], %{}, pool_name: {:ab, m})
    {{:ab, m}, ref}
  end)

up = fn pool ->
  {:error, _} = VllmBridge.call({"vllm_bridge.diag", "sleep"}, [big], %{}, pool_name: pool)
  :ok
end

down = fn pool ->
  {:ok, %Tensor{}} = VllmBridge.get({holders[pool], "value"}, pool_name: pool)
  :ok
end

one_way = fn f ->
  fn pool -> %{ms: Stats.median(Stats.time_calls(1, fn -> f.(pool) end)) / 1000} end
end

# Each figure on its own: `rounds` rounds, each measuring both framings, the order
# alternating (A B, then B A); the median of the rounds' figures.
ab = fn name, rounds, fun ->
  for m <- modes, do: fun.({:ab, m})

  per_round =
    for r <- 1..rounds do
      order = if rem(r, 2) == 1, do: modes, else: Enum.reverse(modes)
      Map.new(order, fn m -> {m, fun.({:ab, m})} end)
    end

  keys = Map.keys(per_round |> hd() |> Map.fetch!(:packet))

  for key <- keys do
    a = per_round |> Enum.map(& &1.packet[key]) |> Stats.median()
    b = per_round |> Enum.map(& &1.stream[key]) |> Stats.median()

    IO.puts(
      String.pad_trailing("#{name} #{key}", 34) <>
        String.pad_leading(Stats.fmt(a), 14) <>
        String.pad_leading(Stats.fmt(b), 14) <> "   " <> Stats.fmt(b / a, 3)
    )
  end
end

IO.puts("medians of rounds, each round both framings (A B / B A)")

IO.puts(
  String.pad_trailing("figure", 34) <>
    String.pad_leading("{packet, 4}", 14) <>
    String.pad_leading(":stream", 14) <> "   stream/packet"
)

if "rt" in parts,
  do: ab.("round trip (us, #{rounds * 2 + 1} rounds of 1500)", rounds * 2 + 1, latency)

if "thr" in parts, do: ab.("throughput 64 callers (calls/s, #{rounds} x 1 s)", rounds, throughput)
if "t1" in parts, do: ab.("1 MiB echo (ms, #{rounds} rounds of 5)", rounds, tensor.(1, 5))
if "t16" in parts, do: ab.("16 MiB echo (ms, #{rounds} rounds of 2)", rounds, tensor.(16, 2))
if "t64" in parts, do: ab.("64 MiB echo (ms, #{rounds} rounds of 1)", rounds, tensor.(64, 1))
if "up64" in parts, do: ab.("64 MiB request only (ms, #{rounds} x 1)", rounds, one_way.(up))
if "down64" in parts, do: ab.("64 MiB reply only (ms, #{rounds} x 1)", rounds, one_way.(down))

IO.puts("load average: #{File.read!("/proc/loadavg") |> String.trim()}")
for m <- modes, do: VllmBridge.stop_pool({:ab, m})
