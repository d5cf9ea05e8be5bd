defmodule VllmBridge.Bench.Latency do
  @moduledoc """
  Round trip of the trivial call (`VllmBridge.Bench.Trivial`) through the whole stack,
  one caller, one call at a time, beside a raw Port echo of a frame of the same size
  (`VllmBridge.Bench.RawEcho`, a port the caller owns). The two alternate in rounds so
  that a busy moment of a shared machine lands on both.
  """

  alias VllmBridge.Bench.{Pinning, RawEcho, Stats, Trivial}

  @doc """
  Measures both: `%{full: samples_us, raw: samples_us, frame_bytes: n, pinned: cpu | nil}`.
  Options: `:calls` (timed calls of each, default 10 000), `:rounds` (default 10),
  `:warmup` (default 1 000), `:pin` (a CPU: the BEAM's threads, the pool's Python workers
  and the echo all run on it while measuring; see `VllmBridge.Bench.Pinning`).
  """
  @spec run(term(), String.t(), keyword()) :: map()
  def run(pool, python, opts) do
    calls = Keyword.get(opts, :calls, 10_000)
    rounds = Keyword.get(opts, :rounds, 10)
    warmup = Keyword.get(opts, :warmup, 1_000)
    per_round = max(1, div(calls, rounds))
    frame = Trivial.request_frame()
    port = RawEcho.open(python)
    saved = pin(Keyword.get(opts, :pin), pool, port)

    try do
      full = fn -> Trivial.call(pool_name: pool) end
      raw = fn -> RawEcho.roundtrip(port, frame) end
      Stats.time_calls(warmup, full)
      Stats.time_calls(warmup, raw)

      {full_samples, raw_samples} =
        Enum.reduce(1..rounds, {[], []}, fn _, {f, r} ->
          {Stats.time_calls(per_round, full) ++ f, Stats.time_calls(per_round, raw) ++ r}
        end)

      %{
        full: full_samples,
        raw: raw_samples,
        frame_bytes: byte_size(frame),
        pinned: Keyword.get(opts, :pin)
      }
    after
      Pinning.restore(saved)
      RawEcho.close(port)
    end
  end

  defp pin(nil, _pool, _port), do: []

  defp pin(cpu, pool, port) do
    {:ok, workers} = VllmBridge.Pool.workers(pool)
    {:os_pid, echo} = Port.info(port, :os_pid)
    pids = [System.pid(), echo | Enum.map(workers, & &1.os_pid)]

    case Pinning.pin(pids, cpu) do
      {:ok, saved} -> saved
      {:error, reason} -> raise "could not pin the benchmark to CPU #{cpu}: #{reason}"
    end
  end
end
