defmodule VllmBridge.Bench do
  @moduledoc """
  The bridge's benchmark suite (`make bench`, `mix vllm.bench`), every part in one run,
  each beside a floor measured in the same run, printed as ratios with the targets of
  issue 7 marked PASS or MISS (see bench/README.md for the figures):

    1. round trip of the trivial call through the whole stack vs a raw Port echo
       (`VllmBridge.Bench.Latency`): p50 within 1.3x of the echo's; measured twice, in
       the placement the OS picks and with everything pinned to one CPU
       (`VllmBridge.Bench.Pinning`: on a VM the placement alone moves a round trip 5x);
    2. throughput, 2 workers and 64 callers vs 2 raw echo ports
       (`VllmBridge.Bench.Throughput`): at least 40% of the echo's calls/s. The echo
       pipelines every caller, so the pool gets room for all of them too
       (`max_in_flight: 32` per worker); the default pool (16 per worker: half the
       callers wait in the pool's queue) is measured and reported beside it;
    3. `multiprocessing.Pool.apply` of the same call (`bench/mp_peer.py`): the full stack's
       p50 at least 2x faster;
    4. tensor round trips of 1, 16 and 64 MiB (`VllmBridge.Bench.Tensors`): the full
       stack (shared memory from the threshold on), the same with shared memory off, and
       the raw echo; 64 MiB at 1 GB/s or more;
    5. `bench/forward_context_bench.py`, printed as it reports itself;
    6. the Python side alone (`bench/worker_alone.py`): the worker and the raw echo, each
       driven over its pipes by one Python process with 32 requests in flight, no BEAM:
       calls/s and CPU per call, so the throughput of part 2 can be read as the
       Python worker's share and the BEAM's. No target; printed as it reports itself;
    7. CUDA graphs (`bench/cudagraph_bench.py`): the demo model's decode steps of batch
       1, 2, 4, 8 and a mixed batch, graph replay (FULL, PIECEWISE) against eager, step
       and capture time; target (issue 16, H100) replay at least 3x faster than eager for
       decode batches of 8 or fewer, judged by the script itself. Without a CUDA device
       it prints "skipped: needs a CUDA device";
    8. micro-batch overlap (`bench/ubatch_bench.py`): DP=2 MoE steps over gloo, the two
       micro-batches overlapped on two threads against run one after the other, on the
       CPU and on CUDA when present; target (issue 17, GPU) overlap at least 1.15x
       faster, judged by the script itself;
    9. erlport (`VllmBridge.Bench.Erlport`, issue 19), when `ERLPORT_DIR` holds a build of
       it (`bench/erlport/build.sh`): `:python.call` of the same Python function beside
       the full stack and the raw echo, round trip (as the OS places the processes, all
       on one CPU, and the Python processes on another CPU than the BEAM's) and
       throughput, and binary round trips of 1, 16 and 64 MiB beside part 4's tensors;
       targets: the full stack's p50 at or below erlport's (as the OS places them, and
       both on one CPU), its throughput at least 1.3x erlport's, 64 MiB tensors at 1 GB/s
       or more and at least 2x the raw echo's figure. Skipped, saying why, without erlport.

  The report is printed and written to `bench/out/bench-<time>.txt` and
  `bench/out/latest.txt`.
  """

  alias VllmBridge.Bench.{Erlport, Latency, Pinning, PythonPeers, Stats, Tensors, Throughput}

  @pool :vllm_bench

  @quick [
    latency: [calls: 1_000, rounds: 5, warmup: 100],
    throughput: [duration_ms: 300],
    mp: [calls: 300, warmup: 30],
    tensors: [sizes_mib: [1, 16], reps: &__MODULE__.one_rep/1],
    erlport: [
      calls: 500,
      rounds: 5,
      warmup: 50,
      duration_ms: 300,
      sizes_mib: [1],
      reps: &__MODULE__.one_rep/1
    ],
    fc_args: ["--iterations", "1000", "--repeats", "2"],
    alone_args: ["--calls", "2000", "--rounds", "1"],
    graph_args: ["--steps", "3", "--warmup", "1"],
    ubatch_args: ["--steps", "2", "--warmup", "1", "--repeats", "1"]
  ]

  @doc false
  @spec one_rep(pos_integer()) :: 1
  def one_rep(_mib), do: 1

  @doc """
  Runs every part. Options: `:quick` (tiny counts: checks the machinery, not the speed),
  `:write` (write bench/out files, default true), `:out` (line printer, default
  `IO.puts/1`). Returns `%{report: [line], targets: [{name, :pass | :miss}]}`.
  """
  @spec run(keyword()) :: %{report: [String.t()], targets: [{String.t(), :pass | :miss}]}
  def run(opts \\ []) do
    out = Keyword.get(opts, :out, &IO.puts/1)
    part = fn key -> if opts[:quick], do: @quick[key], else: [] end
    python = Application.fetch_env!(:vllm_bridge, :python)
    say = fn line -> out.(line) && line end

    say.("starting a pool of 2 workers and the raw echo processes ...")
    {:ok, _} = VllmBridge.start_pool(@pool, size: 2, max_in_flight: 32)

    {hello, lat, thr, ten, erl} =
      try do
        {:ok, [w | _]} = VllmBridge.Pool.workers(@pool)
        hello = VllmBridge.Worker.hello(w.pid)
        say.("round trip (section 1) ...")
        lat = Latency.run(@pool, python, part.(:latency))

        pinned =
          if Pinning.available?(),
            do: Latency.run(@pool, python, Keyword.put(part.(:latency), :pin, 0))

        polling = polling_latency(python, part.(:latency))
        lat = lat |> Map.put(:pinned_run, pinned) |> Map.put(:polling_run, polling)
        say.("throughput (section 2) ...")
        thr = Throughput.run(@pool, python, part.(:throughput))
        thr = Map.put(thr, :default_pool, default_pool_rate(part.(:throughput)))
        say.("tensors (section 4) ...")
        ten = Tensors.run(@pool, python, part.(:tensors))
        erl = erlport_part(python, part.(:erlport), say)
        {hello, lat, thr, ten, erl}
      after
        VllmBridge.stop_pool(@pool)
      end

    say.(
      "the Python parts: multiprocessing, forward context, worker alone, CUDA graphs, " <>
        "micro-batch overlap (3, 5-8) ..."
    )

    mp = PythonPeers.mp_pool_apply(python, part.(:mp))

    # Sections 5 to 8, printed as the scripts report themselves.
    printed =
      for {title, script, args} <- [
            {"5. forward context", "forward_context_bench.py", :fc_args},
            {"6. the Python side alone", "worker_alone.py", :alone_args},
            {"7. CUDA graphs", "cudagraph_bench.py", :graph_args},
            {"8. micro-batch overlap", "ubatch_bench.py", :ubatch_args}
          ] do
        lines = PythonPeers.lines(python, script, part.(args))
        ["", "#{title} (bench/#{script})" | Enum.map(lines, &("   " <> &1))]
      end

    {report, targets} = report(hello, lat, thr, mp, ten, Enum.concat(printed), opts[:quick])

    {report, targets} = erlport_report(report, targets, erl, ten)
    Enum.each(report, out)
    if Keyword.get(opts, :write, true), do: write(report, out)
    %{report: report, targets: targets}
  end

  # Part 9, or why it is skipped.
  defp erlport_part(python, opts, say) do
    case Erlport.find() do
      {:ok, dir} ->
        say.("erlport (section 9, #{dir}) ...")
        Map.put(Erlport.run(@pool, python, opts), :dir, dir)

      {:skip, why} ->
        say.("erlport (section 9): skipped: #{why}")
        {:skip, why}
    end
  end

  # Part 9's lines go before the targets; its targets after the others.
  defp erlport_report(report, targets, erl, ten) do
    {head, tail} = Enum.split_while(report, &(not String.starts_with?(&1, "targets (")))
    head = if List.last(head) == "", do: Enum.drop(head, -1), else: head
    {lines, new} = Erlport.Report.lines(erl, ten)

    marks = Enum.map(new, fn {name, ok} -> "   #{if ok, do: "PASS", else: "MISS"}  #{name}" end)

    {head ++ lines ++ [""] ++ tail ++ marks,
     targets ++ Enum.map(new, fn {name, ok} -> {name, if(ok, do: :pass, else: :miss)} end)}
  end

  # The round trip through workers that poll 100 us before sleeping (`poll_us`).
  defp polling_latency(python, opts) do
    {:ok, _} = VllmBridge.start_pool(:vllm_bench_poll, size: 2, poll_us: 100)

    try do
      Latency.run(:vllm_bench_poll, python, opts)
    after
      VllmBridge.stop_pool(:vllm_bench_poll)
    end
  end

  # The same throughput through a pool with the default options (max_in_flight 16).
  defp default_pool_rate(opts) do
    {:ok, _} = VllmBridge.start_pool(:vllm_bench_default, size: 2)

    try do
      Throughput.rate_of(:vllm_bench_default, opts)
    after
      VllmBridge.stop_pool(:vllm_bench_default)
    end
  end

  defp report(hello, lat, thr, mp, ten, printed, quick) do
    full50 = Stats.percentile(lat.full, 50)
    raw50 = Stats.percentile(lat.raw, 50)
    ratio = full50 / raw50
    share = thr.full / thr.raw
    speedup = mp.p50 / full50
    big = Enum.max_by(ten, & &1.mib)
    gbps = big.bytes / (big.full_ms / 1000) / 1.0e9

    pinned_target =
      case lat.pinned_run do
        nil ->
          []

        p ->
          r = Stats.percentile(p.full, 50) / Stats.percentile(p.raw, 50)

          [
            {"round trip p50 within 1.3x of the raw echo, pinned to one CPU (#{Stats.fmt(r, 2)}x)",
             r <= 1.3}
          ]
      end

    targets =
      [
        {"round trip p50 within 1.3x of the raw echo (#{Stats.fmt(ratio, 2)}x)", ratio <= 1.3}
        | pinned_target
      ] ++
        [
          {"throughput at least 40% of the raw echo's (#{Stats.fmt(share * 100)}%)",
           share >= 0.4},
          {"at least 2x faster than multiprocessing.Pool.apply (#{Stats.fmt(speedup, 2)}x)",
           speedup >= 2.0},
          {"#{big.mib} MiB tensors at 1 GB/s or more (#{Stats.fmt(gbps, 2)} GB/s)",
           big.mib >= 64 and gbps >= 1.0}
        ]

    lines =
      header(hello, quick) ++
        latency_lines(lat, full50, raw50, ratio) ++
        throughput_lines(thr, share) ++
        mp_lines(mp, full50, speedup) ++
        tensor_lines(ten) ++
        printed ++
        ["", "targets (ratios against floors measured in this run):"] ++
        Enum.map(targets, fn {name, ok} -> "   #{if ok, do: "PASS", else: "MISS"}  #{name}" end)

    {lines, Enum.map(targets, fn {name, ok} -> {name, if(ok, do: :pass, else: :miss)} end)}
  end

  defp header(hello, quick) do
    cpu =
      case File.read("/proc/cpuinfo") do
        {:ok, info} ->
          Regex.run(~r/model name\s*:\s*(.+)/, info, capture: :all_but_first) || ["?"]

        _ ->
          ["?"]
      end

    load =
      case File.read("/proc/loadavg") do
        {:ok, text} ->
          "; load average at the end #{text |> String.split() |> Enum.take(3) |> Enum.join(" ")}"

        _ ->
          ""
      end

    [
      "vllm_bridge benchmarks (mix vllm.bench)#{if quick, do: " -- QUICK: counts too small for figures", else: ""}",
      "host: #{System.schedulers_online()} cores (#{hd(cpu)}); OTP #{System.otp_release()}, " <>
        "Elixir #{System.version()}; Python #{hello["python"]}, torch #{hello["torch"]}, device #{hello["device"]}#{load}"
    ]
  end

  defp latency_lines(lat, full50, raw50, ratio) do
    [
      "",
      "1. round trip, one caller: Vllm.ForwardContext.Module.is_forward_context_available() " <>
        "(#{length(lat.full)} calls each; request frame #{lat.frame_bytes} bytes)",
      "   placement as the OS picks it:",
      "   full stack (binding -> pool -> worker -> Python)  p50 #{us(full50)}  p99 #{us(Stats.percentile(lat.full, 99))}",
      "   raw Port echo (bench/raw_echo.py, same frame)     p50 #{us(raw50)}  p99 #{us(Stats.percentile(lat.raw, 99))}",
      "   full / raw at p50: #{Stats.fmt(ratio, 2)}x"
    ] ++ pinned_lines(lat.pinned_run) ++ polling_lines(lat.polling_run)
  end

  defp pinned_lines(nil),
    do: ["   (not pinned to one CPU: needs Linux and taskset)"]

  defp pinned_lines(p),
    do: placement_lines("BEAM, workers and echo pinned to CPU #{p.pinned}:", p)

  defp polling_lines(p),
    do:
      placement_lines(
        "placement as the OS picks it, workers started with poll_us: 100 (not a default):",
        p
      )

  defp placement_lines(title, run) do
    full50 = Stats.percentile(run.full, 50)
    raw50 = Stats.percentile(run.raw, 50)

    [
      "   " <> title,
      "   full stack                                        p50 #{us(full50)}  p99 #{us(Stats.percentile(run.full, 99))}",
      "   raw Port echo                                     p50 #{us(raw50)}  p99 #{us(Stats.percentile(run.raw, 99))}",
      "   full / raw at p50: #{Stats.fmt(full50 / raw50, 2)}x"
    ]
  end

  defp throughput_lines(thr, share) do
    [
      "",
      "2. throughput: #{thr.callers} concurrent callers, #{Stats.fmt(thr.seconds)} s per round, best of 2",
      "   full stack, 2 workers, max_in_flight 32 (every caller pipelined)  #{rate(thr.full)} calls/s",
      "   raw echo, 2 ports (FIFO owners, every caller pipelined)          #{rate(thr.raw)} calls/s",
      "   full / raw: #{Stats.fmt(share * 100)}%",
      "   (default pool, max_in_flight 16: half the callers queue in the pool #{rate(thr.default_pool)} calls/s, " <>
        "#{Stats.fmt(thr.default_pool / thr.raw * 100)}% of the echo)"
    ]
  end

  defp mp_lines(mp, full50, speedup) do
    [
      "",
      "3. Python peer: multiprocessing.Pool(1).apply(is_forward_context_available) (#{mp.calls} calls)",
      "   p50 #{us(mp.p50)}  p99 #{us(mp.p99)}; the full stack's p50 #{us(full50)} is #{Stats.fmt(speedup, 2)}x faster"
    ]
  end

  defp tensor_lines(ten) do
    rows =
      Enum.map(ten, fn t ->
        [full, pipe, raw] =
          Enum.map([t.full_ms, t.pipe_ms, t.raw_ms], &(t.bytes / (&1 / 1000) / 1.0e9))

        "   #{String.pad_leading("#{t.mib}", 3)} MiB  #{pad(Stats.fmt(t.full_ms), 9)} ms  " <>
          "#{pad(Stats.fmt(full, 2), 6)} GB/s   #{pad(Stats.fmt(t.pipe_ms), 9)} ms  " <>
          "#{pad(Stats.fmt(pipe, 2), 6)} GB/s   #{pad(Stats.fmt(t.raw_ms), 9)} ms  " <>
          "#{pad(Stats.fmt(raw, 2), 6)} GB/s   #{pad(Stats.fmt(full / raw, 2), 5)}x  " <>
          "#{pad(Stats.fmt(full / pipe, 2), 5)}x  (median of #{t.reps})"
      end)

    [
      "",
      "4. tensors: float32 round trip through diag.echo (GB/s = tensor bytes / median round trip)",
      "   full stack: shared memory from #{shm_threshold()}; full stack, pipe only: the same with it off",
      "   size     full stack                full stack, pipe only     raw echo (same frame size)  " <>
        "full/raw  full/pipe"
      | rows
    ]
  end

  defp shm_threshold do
    case VllmBridge.Shm.dir() do
      %{min_bytes: m} -> "#{Stats.fmt(m / 1_048_576, 1)} MiB (#{VllmBridge.Shm.dir().path})"
      :disabled -> "nowhere (no slot directory: every tensor takes the pipe)"
    end
  end

  defp us(x), do: String.pad_leading(Stats.fmt(x), 7) <> " us"
  defp rate(x), do: String.pad_leading(Integer.to_string(round(x)), 8)
  defp pad(text, n), do: String.pad_leading(text, n)

  defp write(report, out) do
    dir = Path.expand("bench/out")
    File.mkdir_p!(dir)
    stamp = Calendar.strftime(DateTime.utc_now(), "%Y%m%dT%H%M%SZ")
    text = Enum.join(report, "\n") <> "\n"
    File.write!(Path.join(dir, "bench-#{stamp}.txt"), text)
    File.write!(Path.join(dir, "latest.txt"), text)
    out.("written to bench/out/bench-#{stamp}.txt and bench/out/latest.txt")
  end
end
