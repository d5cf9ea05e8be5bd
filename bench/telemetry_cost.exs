# What telemetry costs the round trip (issue 18): the trivial call of `mix vllm.bench`
# part 1 (`VllmBridge.Bench.Trivial`, through the whole stack), one caller, timed in
# rounds that alternate between
#
#   * off  - no `:telemetry` loaded: what an app without it pays (the one check);
#   * idle - a `:telemetry` loaded, no handler attached to the bridge's events: the
#            spans are built and emitted, nobody listens;
#   * on   - a handler attached to the call span's events (it does nothing): the whole
#            enabled path, handlers included.
#
# `:telemetry` here is the tests' stand-in (test/support/telemetry_stand_in.exs), loaded
# and unloaded between rounds, so the three run in one BEAM against one worker. The
# stand-in looks handlers up by walking its table, the real library by an ETS lookup of
# the event: "idle" and "on" are indicative, "off" is exact.
#
# To compare with a build without telemetry (before issue 18), run the same script in
# both trees, alternating (see bench/results/telemetry-and-status.md, "Telemetry"):
#
#   mix run bench/telemetry_cost.exs [--modes off,idle,on] [--rounds 5] [--calls 5000]
#                                    [--pin 0] [--label name]
#
# Prints one line per mode: p50 and mean in microseconds over all its rounds, and each
# round's p50.

{opts, _, _} =
  OptionParser.parse(System.argv(),
    strict: [modes: :string, rounds: :integer, calls: :integer, pin: :integer, label: :string]
  )

modes =
  opts |> Keyword.get(:modes, "off,idle,on") |> String.split(",") |> Enum.map(&String.to_atom/1)

rounds = Keyword.get(opts, :rounds, 5)
calls = Keyword.get(opts, :calls, 5_000)
label = Keyword.get(opts, :label, "this tree")

alias VllmBridge.Bench.{Pinning, Stats, Trivial}

stand_in = Path.expand("../test/support/telemetry_stand_in.exs", __DIR__)

# The stand-in compiled once, then loaded and unloaded by mode.
[{:telemetry, beam}] = Code.compile_file(stand_in)

unload = fn ->
  :code.purge(:telemetry)
  :code.delete(:telemetry)
  :code.purge(:telemetry)
  false = :erlang.function_exported(:telemetry, :execute, 3)
end

load = fn ->
  if not :erlang.function_exported(:telemetry, :execute, 3) do
    {:module, :telemetry} = :code.load_binary(:telemetry, ~c"telemetry_stand_in", beam)
  end
end

handler = {:telemetry_cost, :noop}
events = for e <- [:start, :stop, :exception], do: [:vllm_bridge, :call, e]

set_mode = fn
  :off ->
    unload.()

  :idle ->
    load.()
    :telemetry.detach(handler)

  :on ->
    load.()
    :telemetry.detach(handler)
    :ok = :telemetry.attach_many(handler, events, fn _e, _m, _md, _c -> :ok end, nil)
end

pool = :telemetry_cost
{:ok, _} = VllmBridge.start_pool(pool, size: 1)
{:ok, [w]} = VllmBridge.Pool.workers(pool)

saved =
  case opts[:pin] do
    nil ->
      []

    cpu ->
      {:ok, saved} = Pinning.pin([System.pid(), w.os_pid], cpu)
      saved
  end

call = fn -> Trivial.call(pool_name: pool) end

try do
  for mode <- modes do
    set_mode.(mode)
    Stats.time_calls(1_000, call)
  end

  samples =
    Enum.reduce(1..rounds, %{}, fn _round, acc ->
      Enum.reduce(modes, acc, fn mode, acc ->
        set_mode.(mode)
        s = Stats.time_calls(calls, call)
        Map.update(acc, mode, [s], &[s | &1])
      end)
    end)

  IO.puts("#{label}: #{rounds} rounds x #{calls} calls per mode, pinned: #{inspect(opts[:pin])}")

  for mode <- modes do
    per_round = Enum.reverse(samples[mode])
    all = List.flatten(per_round)
    mean = Enum.sum(all) / length(all)
    p50s = Enum.map_join(per_round, " ", &Stats.fmt(Stats.median(&1)))

    IO.puts(
      "  #{mode}: p50 #{Stats.fmt(Stats.median(all))} us, mean #{Stats.fmt(mean)} us " <>
        "(each round's p50: #{p50s})"
    )
  end
after
  Pinning.restore(saved)
  VllmBridge.stop_pool(pool)
end
