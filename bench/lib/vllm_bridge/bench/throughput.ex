defmodule VllmBridge.Bench.Throughput do
  @moduledoc """
  Calls per second with many concurrent callers: the trivial call through a pool of 2
  workers, beside 2 raw echo ports, each with an owner process that pipelines its callers'
  frames and answers them in FIFO order (`VllmBridge.Bench.RawEcho`). Callers are spread
  over the two ports round-robin. Each side runs for a fixed time, twice, alternating;
  the better round of each counts.
  """

  alias VllmBridge.Bench.{RawEcho, Stats, Trivial}

  @doc """
  Measures both: `%{full: calls_per_s, raw: calls_per_s, callers: n, seconds: s}`.
  Options: `:callers` (default 64), `:duration_ms` (each round, default 3 000).
  """
  @spec run(term(), String.t(), keyword()) :: map()
  def run(pool, python, opts) do
    callers = Keyword.get(opts, :callers, 64)
    duration = Keyword.get(opts, :duration_ms, 3_000)
    frame = Trivial.request_frame()
    owners = [RawEcho.start_owner(python), RawEcho.start_owner(python)]

    try do
      full = fn _i -> Trivial.call(pool_name: pool) end
      raw = fn i -> RawEcho.call(Enum.at(owners, rem(i, 2)), frame) end

      rates =
        for _round <- 1..2, do: {rate(full, callers, duration), rate(raw, callers, duration)}

      %{
        full: rates |> Enum.map(&elem(&1, 0)) |> Enum.max(),
        raw: rates |> Enum.map(&elem(&1, 1)) |> Enum.max(),
        callers: callers,
        seconds: duration / 1000
      }
    after
      Enum.each(owners, &RawEcho.stop_owner/1)
    end
  end

  @doc """
  Calls per second of the trivial call through pool `pool` alone (best of 2 rounds), with
  the options of `run/3`.
  """
  @spec rate_of(term(), keyword()) :: float()
  def rate_of(pool, opts) do
    callers = Keyword.get(opts, :callers, 64)
    duration = Keyword.get(opts, :duration_ms, 3_000)
    full = fn _i -> Trivial.call(pool_name: pool) end
    Enum.max(for _round <- 1..2, do: rate(full, callers, duration))
  end

  @doc """
  Calls per second of `call.(i)` made in a loop by `callers` processes (`i` = 1..callers)
  from a common start for `duration` ms; every result must pass `Stats.check!/1`.
  """
  @spec rate((pos_integer() -> term()), pos_integer(), pos_integer()) :: float()
  def rate(call, callers, duration) do
    {total, elapsed_us} = count(call, callers, duration)
    total / (elapsed_us / 1_000_000)
  end

  @doc """
  The loop of `rate/3`, for benchmarks that measure more around it
  (bench/short_callers.exs): `{calls made, microseconds from the common start until the
  last caller was done}`.
  """
  @spec count((pos_integer() -> term()), pos_integer(), pos_integer()) ::
          {non_neg_integer(), pos_integer()}
  def count(call, callers, duration) do
    parent = self()

    pids =
      for i <- 1..callers do
        spawn_link(fn ->
          receive do
            {:go, deadline} -> send(parent, {:done, self(), loop(call, i, deadline, 0)})
          end
        end)
      end

    start = System.monotonic_time(:microsecond)
    Enum.each(pids, &send(&1, {:go, div(start, 1000) + duration}))

    total =
      Enum.reduce(pids, 0, fn pid, acc ->
        receive do
          {:done, ^pid, n} -> acc + n
        end
      end)

    {total, max(System.monotonic_time(:microsecond) - start, 1)}
  end

  defp loop(call, i, deadline, n) do
    if System.monotonic_time(:millisecond) >= deadline do
      n
    else
      Stats.check!(call.(i))
      loop(call, i, deadline, n + 1)
    end
  end
end
