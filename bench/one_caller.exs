# One caller, the trivial call: p50 and the CPU each side spends a call, for the whole
# stack, its steps fused into one function (VllmBridge.Bench.Fused: what flattening the
# Elixir path's layers could gain), the least path (VllmBridge.Bench.LeastPath: the
# BEAM's bound), the least path whose caller writes to the port itself (`direct`: one
# process hop less) and erlport, in alternating rounds of one run (issue 19;
# bench/results/caller-path.md).
#
#   ELIXIR_ERL_OPTIONS="+sbwt none +sbwtdcpu none +sbwtdio none" \
#     ERLPORT_DIR=/tmp/erlport mix run bench/one_caller.exs [rounds] [calls] [pin]
#
# CPU a call: the BEAM's and the subject's Python processes' run time over the round
# (VllmBridge.Bench.ProcCpu), divided by its calls; start the BEAM with its schedulers'
# busy-waiting off (above) so that it is not counted. `pin`: everything on
# CPU 0, which takes the vCPU wake-ups out (VllmBridge.Bench.Pinning) and leaves the work.

alias VllmBridge.Bench.{Erlport, Fused, LeastPath, Pinning, ProcCpu, Stats, Trivial}

{[rounds, n], pin} = Stats.argv(System.argv(), [10, 5_000])

case Erlport.find() do
  {:skip, why} ->
    IO.puts("skipped: #{why}")

  {:ok, _} ->
    python = Application.fetch_env!(:vllm_bridge, :python)
    {:ok, _} = VllmBridge.start_pool(:one_caller, size: 1, max_in_flight: 32)
    {:ok, [w]} = VllmBridge.Pool.workers(:one_caller)
    owner = LeastPath.start(python)
    direct = LeastPath.start(python, :direct)
    peer = Erlport.start_peer(python)
    req = LeastPath.request()
    # (The binding caches its target's encoding, which Fused reads.)
    {:ok, _} = Trivial.call(pool_name: :one_caller)

    subjects = [
      full: {fn -> Trivial.call(pool_name: :one_caller) end, [w.os_pid]},
      fused: {fn -> Fused.call(:one_caller) end, [w.os_pid]},
      least: {fn -> LeastPath.call(owner, req) end, [LeastPath.os_pid(owner)]},
      direct: {fn -> LeastPath.call_direct(direct, req) end, [LeastPath.os_pid(direct)]},
      erlport: {fn -> {:ok, Erlport.call_peer(peer)} end, Erlport.os_pids(peer)}
    ]

    beam = System.pid()

    saved =
      if pin do
        {:ok, saved} = Pinning.pin([beam | Enum.flat_map(subjects, fn {_, {_, p}} -> p end)], pin)
        saved
      else
        []
      end

    Enum.each(subjects, fn {_, {f, _}} ->
      Stats.time_calls(2_000, fn -> Stats.check!(f.()) end)
    end)

    rows =
      Enum.reduce(1..rounds, %{}, fn _, acc ->
        Enum.reduce(subjects, acc, fn {k, {f, pids}}, acc ->
          b0 = ProcCpu.ns([beam])
          p0 = ProcCpu.ns(pids)
          t = Stats.time_calls(n, fn -> Stats.check!(f.()) end)

          row =
            {Stats.percentile(t, 50), (ProcCpu.ns([beam]) - b0) / n / 1000,
             (ProcCpu.ns(pids) - p0) / n / 1000}

          Map.update(acc, k, [row], &[row | &1])
        end)
      end)

    Pinning.restore(saved)
    med = fn xs -> xs |> Enum.sort() |> Enum.at(div(length(xs), 2)) end
    e50 = med.(Enum.map(rows.erlport, &elem(&1, 0)))
    where = if pin, do: "everything on CPU 0", else: "placement as the OS picks it"
    IO.puts("#{rounds} rounds of #{n} calls, #{where}; medians over the rounds")

    for {k, _} <- subjects do
      [p50, b, py] = for i <- 0..2, do: med.(Enum.map(rows[k], &elem(&1, i)))

      IO.puts(
        "  #{String.pad_trailing(to_string(k), 8)} p50 #{Stats.fmt(p50)} us " <>
          "(#{Float.round(p50 / e50, 2)}x erlport), CPU a call BEAM #{Stats.fmt(b)} us, " <>
          "Python #{Stats.fmt(py)} us"
      )
    end

    apply(:python, :stop, [peer])
    VllmBridge.stop_pool(:one_caller)
end
