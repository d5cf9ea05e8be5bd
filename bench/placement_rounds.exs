# The one-caller p50 of each short round, as the OS places the processes (issue 19;
# bench/results/erlport-placement.md): the whole stack's trivial call and erlport's
# `:python.call` of the same function, in alternating rounds, each round's p50 printed
# on its own. A p50 over many rounds hides that the OS moves the processes between two
# placements (the Python side on the BEAM's vCPU, or on the other one) from one round to
# the next; these figures show each round's mode. Run it several times: each run is a
# fresh BEAM and fresh Python processes.
#
#   ERLPORT_DIR=... mix run bench/placement_rounds.exs [rounds calls poll_us]
#
# (defaults 8 rounds of 1 000 calls per subject; `poll_us` 0, the pool's default)

alias VllmBridge.Bench.{Erlport, Stats, Trivial}

[rounds, calls, poll_us] =
  case System.argv() do
    [] -> [8, 1_000, 0]
    [r, c, p] -> Enum.map([r, c, p], &String.to_integer/1)
    _ -> raise "usage: mix run bench/placement_rounds.exs [rounds calls poll_us]"
  end

case Erlport.find() do
  {:skip, why} ->
    IO.puts("skipped: #{why}")

  {:ok, _} ->
    python = Application.fetch_env!(:vllm_bridge, :python)
    {:ok, _} = VllmBridge.start_pool(:rounds, size: 2, max_in_flight: 32, poll_us: poll_us)
    peer = Erlport.start_peer(python)

    subjects = [
      full: fn -> Trivial.call(pool_name: :rounds) end,
      erlport: fn -> if is_boolean(Erlport.call_peer(peer)), do: :ok, else: :bad_reply end
    ]

    Enum.each(subjects, fn {_, f} -> Stats.time_calls(calls, f) end)

    p50s =
      for _ <- 1..rounds, {k, f} <- subjects, reduce: %{full: [], erlport: []} do
        acc -> Map.update!(acc, k, &[Stats.percentile(Stats.time_calls(calls, f), 50) | &1])
      end

    row = fn k -> p50s[k] |> Enum.reverse() |> Enum.map_join(" ", &Stats.fmt/1) end
    IO.puts("poll_us #{poll_us}, p50 of each round of #{calls} calls, us")
    IO.puts("  full:    #{row.(:full)}")
    IO.puts("  erlport: #{row.(:erlport)}")
    apply(:python, :stop, [peer])
    VllmBridge.stop_pool(:rounds)
end
