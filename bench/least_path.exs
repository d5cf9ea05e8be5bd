# The least the BEAM side of a call could do (VllmBridge.Bench.LeastPath), beside the
# whole stack and erlport, in one run (issue 19; bench/results/least-path-and-batching.md,
# "The least a call could do on the BEAM"): is the gap to the targets on the BEAM side,
# or past it?
#
#   ERLPORT_DIR=/tmp/erlport mix run bench/least_path.exs [rounds] [duration_ms] [pin]
#
# One caller: p50 over `rounds` alternating rounds of 2 000 calls of each subject. 64
# callers: calls/s over 2 Python processes each (a pool of 2 with max_in_flight 32, two
# least-path owners, two erlport instances), `rounds` alternating rounds of
# `duration_ms`, with the BEAM's and the Python processes' CPU per call
# (VllmBridge.Bench.ProcCpu; start the BEAM with ELIXIR_ERL_OPTIONS="+sbwt none +sbwtdcpu none +sbwtdio none" so
# that schedulers' busy-waiting is not counted). `pin`: everything on CPU 0.

alias VllmBridge.Bench.{Erlport, LeastPath, Pinning, ProcCpu, Stats, Throughput, Trivial}

{[rounds, duration], pin} = Stats.argv(System.argv(), [5, 2_000])

case Erlport.find() do
  {:skip, why} ->
    IO.puts("skipped: #{why}")

  {:ok, _} ->
    python = Application.fetch_env!(:vllm_bridge, :python)
    {:ok, _} = VllmBridge.start_pool(:least, size: 2, max_in_flight: 32)
    {:ok, workers} = VllmBridge.Pool.workers(:least)
    owners = List.to_tuple([LeastPath.start(python), LeastPath.start(python)])
    peers = List.to_tuple([Erlport.start_peer(python), Erlport.start_peer(python)])
    req = LeastPath.request()

    subjects = [
      full: {fn _i -> Trivial.call(pool_name: :least) end, Enum.map(workers, & &1.os_pid)},
      least:
        {fn i -> LeastPath.call(elem(owners, rem(i, 2)), req) end,
         Enum.map(Tuple.to_list(owners), &LeastPath.os_pid/1)},
      erlport:
        {fn i -> {:ok, Erlport.call_peer(elem(peers, rem(i, 2)))} end,
         Enum.flat_map(Tuple.to_list(peers), &Erlport.os_pids/1)}
    ]

    beam = System.pid()

    saved =
      if pin do
        all = [beam | Enum.flat_map(subjects, fn {_, {_, p}} -> p end)]
        {:ok, saved} = Pinning.pin(all, pin)
        saved
      else
        []
      end

    Enum.each(subjects, fn {_, {f, _}} ->
      Stats.time_calls(1_000, fn -> Stats.check!(f.(1)) end)
    end)

    lat =
      Enum.reduce(1..rounds, %{}, fn _, acc ->
        Enum.reduce(subjects, acc, fn {k, {f, _}}, acc ->
          t = Stats.time_calls(2_000, fn -> Stats.check!(f.(1)) end)
          Map.update(acc, k, t, &(t ++ &1))
        end)
      end)

    thr =
      Enum.reduce(1..rounds, %{}, fn _, acc ->
        Enum.reduce(subjects, acc, fn {k, {f, pids}}, acc ->
          b0 = ProcCpu.ns([beam])
          p0 = ProcCpu.ns(pids)
          {n, us} = Throughput.count(f, 64, duration)
          # (CPU a call in us.)
          row =
            {n / (us / 1.0e6), (ProcCpu.ns([beam]) - b0) / n / 1000,
             (ProcCpu.ns(pids) - p0) / n / 1000}

          Map.update(acc, k, [row], &[row | &1])
        end)
      end)

    Pinning.restore(saved)
    med = fn xs -> xs |> Enum.sort() |> Enum.at(div(length(xs), 2)) end
    e50 = Stats.percentile(lat.erlport, 50)
    erate = med.(Enum.map(thr.erlport, &elem(&1, 0)))
    where = if pin, do: "everything on CPU 0", else: "placement as the OS picks it"
    IO.puts("#{rounds} rounds, #{where}; 64 callers: medians over the rounds")

    for {k, _} <- subjects do
      p50 = Stats.percentile(lat[k], 50)
      rate = med.(Enum.map(thr[k], &elem(&1, 0)))

      IO.puts(
        "  #{String.pad_trailing(to_string(k), 8)} p50 #{Stats.fmt(p50)} us " <>
          "(#{Float.round(p50 / e50, 2)}x erlport)  " <>
          "#{round(rate)} calls/s (#{Float.round(rate / erate, 2)}x erlport), CPU per call " <>
          "BEAM #{Stats.fmt(med.(Enum.map(thr[k], &elem(&1, 1))))} us, " <>
          "Python #{Stats.fmt(med.(Enum.map(thr[k], &elem(&1, 2))))} us"
      )
    end

    Enum.each(Tuple.to_list(peers), &apply(:python, :stop, [&1]))
    VllmBridge.stop_pool(:least)
end
