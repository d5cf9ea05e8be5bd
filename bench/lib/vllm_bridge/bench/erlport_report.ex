defmodule VllmBridge.Bench.Erlport.Report do
  @moduledoc """
  The lines and targets of part 9 (`VllmBridge.Bench.Erlport`): the full stack against
  erlport, both against the raw echo floor, and issue 19's targets. The tensor target
  is judged from part 4's figures even when erlport is skipped.
  """

  alias VllmBridge.Bench.Stats

  @doc """
  `{lines, targets}` for part 9's result `erl` (or `{:skip, why}`) and part 4's tensor
  figures `ten`; each target is `{name, passed?}`.
  """
  @spec lines(map() | {:skip, String.t()}, [map()]) :: {[String.t()], [{String.t(), boolean()}]}
  def lines({:skip, why}, ten) do
    {["", "9. erlport (issue 19): skipped: #{why}"], [tensor_target(ten)]}
  end

  def lines(erl, ten) do
    lat = erl.latency
    [f50, e50, r50] = Enum.map([lat.full, lat.erlport, lat.raw], &Stats.percentile(&1, 50))
    thr = erl.throughput

    lines =
      [
        "",
        "9. erlport v0.11 (ERLPORT_DIR=#{erl.dir}), in the same run, rounds alternating",
        "   round trip, one caller (#{length(lat.full)} calls each); erlport runs the same Python " <>
          "function: :python.call(p, :\"vllm_bridge.forward_context\", :is_forward_context_available, [])",
        row("full stack", lat.full),
        row("erlport :python.call", lat.erlport),
        row("raw Port echo", lat.raw),
        "   p50 ratios: full / erlport #{x(f50 / e50)}, full / raw #{x(f50 / r50)}, erlport / raw #{x(e50 / r50)}"
      ] ++
        placed_lines(lat.placed) ++
        [
          "   throughput, #{thr.callers} callers, 2 Python processes each, best of 2 rounds of #{Stats.fmt(thr.seconds)} s:",
          "   full stack (max_in_flight 32) #{rate(thr.full)} calls/s, erlport #{rate(thr.erlport)} calls/s, " <>
            "raw echo #{rate(thr.raw)} calls/s",
          "   full / erlport #{x(thr.full / thr.erlport)}, full / raw #{pct(thr.full / thr.raw)}, " <>
            "erlport / raw #{pct(thr.erlport / thr.raw)}",
          "   binary round trips: erlport echoes bytes (diag.echo); full stack (shared memory from " <>
            "the threshold on) and raw echo are part 4's tensor figures",
          "   size     full stack      erlport         raw echo        full/erlport  full/echo  erlport/echo"
        ] ++ binary_rows(erl.binaries, ten)

    targets = [
      {"full-stack round trip p50 at or below erlport's (#{Stats.fmt(f50)} / #{Stats.fmt(e50)} us = #{x(f50 / e50)})",
       f50 <= e50},
      one_cpu_target(lat.placed),
      {"throughput at least 1.3x erlport's (#{x(thr.full / thr.erlport)})",
       thr.full >= 1.3 * thr.erlport},
      tensor_target(ten)
    ]

    {lines, Enum.reject(targets, &is_nil/1)}
  end

  @placements [
    one_cpu: "the BEAM and every Python process on CPU 0",
    apart: "the BEAM on CPU 0, every Python process on CPU 1"
  ]

  # The same round trips in the placements set by taskset (VllmBridge.Bench.Erlport).
  defp placed_lines({:skip, why}), do: ["   (set placements skipped: #{why})"]

  defp placed_lines(placed) do
    Enum.flat_map(placed, fn {where, lat} ->
      [f50, e50, r50] = Enum.map([lat.full, lat.erlport, lat.raw], &Stats.percentile(&1, 50))

      [
        "   #{@placements[where]}:",
        row("full stack", lat.full),
        row("erlport :python.call", lat.erlport),
        row("raw Port echo", lat.raw),
        "   p50 ratios: full / erlport #{x(f50 / e50)}, full / raw #{x(f50 / r50)}, erlport / raw #{x(e50 / r50)}"
      ]
    end)
  end

  # Both stacks in one placement, the same for both: the comparison of their code.
  defp one_cpu_target(placed) do
    case placed do
      [{:one_cpu, %{full: f, erlport: e}} | _] ->
        [f50, e50] = Enum.map([f, e], &Stats.percentile(&1, 50))

        {"full-stack round trip p50 at or below erlport's, both on one CPU " <>
           "(#{Stats.fmt(f50)} / #{Stats.fmt(e50)} us = #{x(f50 / e50)})", f50 <= e50}

      _ ->
        nil
    end
  end

  defp tensor_target(ten) do
    big = Enum.max_by(ten, & &1.mib)
    full = gbps(big.bytes, big.full_ms)
    raw = gbps(big.bytes, big.raw_ms)

    {"#{big.mib} MiB tensors at 1 GB/s or more and at least 2x the pipe echo " <>
       "(#{Stats.fmt(full, 2)} GB/s, #{x(full / raw)} the echo's #{Stats.fmt(raw, 2)})",
     big.mib >= 64 and full >= 1.0 and full >= 2 * raw}
  end

  defp binary_rows(bins, ten) do
    Enum.map(bins, fn b ->
      erl = gbps(b.bytes, b.ms)

      case Enum.find(ten, &(&1.mib == b.mib)) do
        nil ->
          "   #{mib(b.mib)}  (not in part 4)  #{gb(erl)}"

        t ->
          full = gbps(t.bytes, t.full_ms)
          raw = gbps(t.bytes, t.raw_ms)

          "   #{mib(b.mib)}  #{gb(full)}  #{gb(erl)}  #{gb(raw)}  " <>
            "#{String.pad_leading(x(full / erl), 12)}  #{String.pad_leading(x(full / raw), 9)}  " <>
            String.pad_leading(x(erl / raw), 12)
      end
    end)
  end

  defp row(label, samples) do
    "   #{String.pad_trailing(label, 24)} p50 #{us(Stats.percentile(samples, 50))}  p99 #{us(Stats.percentile(samples, 99))}"
  end

  defp gbps(bytes, ms), do: bytes / (ms / 1000) / 1.0e9
  defp gb(v), do: String.pad_leading(Stats.fmt(v, 3), 9) <> " GB/s"
  defp mib(m), do: String.pad_leading("#{m}", 3) <> " MiB"
  defp us(v), do: String.pad_leading(Stats.fmt(v), 7) <> " us"
  defp x(r), do: Stats.fmt(r, 2) <> "x"
  defp pct(r), do: Stats.fmt(r * 100) <> "%"
  defp rate(v), do: Integer.to_string(round(v))
end
