defmodule VllmBridge.Bench.Stats do
  @moduledoc "Summaries of timing samples for the benchmarks (`mix vllm.bench`)."

  @doc "Nearest-rank percentile `p` (0..100) of a list of numbers."
  @spec percentile([number()], number()) :: number()
  def percentile([], _p), do: raise(ArgumentError, "percentile of no samples")

  def percentile(samples, p) when p >= 0 and p <= 100 do
    sorted = Enum.sort(samples)
    n = length(sorted)
    rank = (p / 100 * n) |> Float.ceil() |> trunc() |> max(1) |> min(n)
    Enum.at(sorted, rank - 1)
  end

  @doc "The median."
  @spec median([number()]) :: number()
  def median(samples), do: percentile(samples, 50)

  @doc """
  Times `fun` `n` times, one call after the other: the samples in microseconds (float).
  `fun` must return `:ok` or `{:ok, _}`; anything else raises, naming what came back.
  """
  @spec time_calls(pos_integer(), (() -> term())) :: [float()]
  def time_calls(n, fun) do
    for _ <- 1..n do
      t0 = System.monotonic_time(:nanosecond)
      result = fun.()
      dt = System.monotonic_time(:nanosecond) - t0
      check!(result)
      dt / 1000
    end
  end

  @doc "Raises unless `result` is `:ok` or `{:ok, _}`."
  @spec check!(term()) :: :ok
  def check!(:ok), do: :ok
  def check!({:ok, _}), do: :ok

  def check!(other),
    do: raise("a benchmarked call failed: #{inspect(other, limit: 8, printable_limit: 200)}")

  @doc """
  A script's arguments `[n1 n2 ... pin]`: up to `length(defaults)` integers, each missing
  one its default, then anything more asks for everything to be pinned to CPU 0
  (`VllmBridge.Bench.Pinning`): `{integers, 0}`, or `{integers, nil}` without it.

      iex> VllmBridge.Bench.Stats.argv(["3"], [5, 2_000])
      {[3, 2000], nil}
      iex> VllmBridge.Bench.Stats.argv(["3", "100", "pin"], [5, 2_000])
      {[3, 100], 0}
  """
  @spec argv([String.t()], [integer()]) :: {[integer()], 0 | nil}
  def argv(args, defaults) do
    {given, rest} = Enum.split(args, length(defaults))
    ints = Enum.map(given, &String.to_integer/1) ++ Enum.drop(defaults, length(given))
    {ints, if(rest == [], do: nil, else: 0)}
  end

  @doc "A number with `decimals` decimals."
  @spec fmt(number(), non_neg_integer()) :: String.t()
  def fmt(x, decimals \\ 1), do: :erlang.float_to_binary(x / 1, decimals: decimals)
end
