defmodule VllmBridge.TestSupport.TermGen do
  @moduledoc false
  # Seeded random terms (the caller seeds `:rand`) for the codec's property test
  # (test/codec/property_test.exs) and the worker's echo fuzz test
  # (test/runtime/echo_fuzz_test.exs): leaves of the kinds both draw, and nested terms
  # built from a test's own leaves, keys and extra shapes.

  import Bitwise

  alias VllmBridge.Tensor

  @doc "An integer of a random size, from 1 to 300 bits, of either sign."
  def integer do
    bits = Enum.random([1, 4, 7, 8, 15, 16, 31, 32, 63, 64, 65, 100, 300])
    n = :rand.uniform(1 <<< bits) - 1
    if :rand.uniform(2) == 1, do: n, else: -n
  end

  @doc "Any finite float: random bits with the exponent kept below the NaN/inf one."
  def float do
    <<f::float-64>> =
      <<:rand.uniform(2) - 1::1, :rand.uniform(0x7FF) - 1::11, :rand.uniform(1 <<< 52) - 1::52>>

    f
  end

  @doc "A UTF-8 string of one of `lengths` characters (1 to 4 bytes each)."
  def string(lengths) do
    for _ <- 1..Enum.random(lengths)//1,
        into: "",
        do: <<Enum.random([?a, ?b, ?Z, ?0, 0xE9, 0x2713, 0x1F600])::utf8>>
  end

  @doc "A binary that is not UTF-8 (so it travels as msgpack bin): 0xFF, then one of `lengths` random bytes."
  def bytes(lengths), do: <<0xFF, :rand.bytes(Enum.random(lengths))::binary>>

  @doc """
  A tensor of a random dtype, up to `max_dims` dimensions of up to `max_size` elements
  each, on one of `devices`.
  """
  def tensor(max_dims, max_size, devices \\ ["cpu"]) do
    dtype = Enum.random(Tensor.dtypes())
    shape = for _ <- 1..(:rand.uniform(max_dims + 1) - 1)//1, do: :rand.uniform(max_size + 1) - 1
    n = Enum.reduce(shape, 1, &(&1 * &2)) * Tensor.itemsize(dtype)
    data = :rand.bytes(n)
    data = if dtype == :bool, do: for(<<b <- data>>, into: <<>>, do: <<b &&& 1>>), else: data
    Tensor.new(data, dtype, shape, device: Enum.random(devices))
  end

  @doc """
  A term nested up to `depth` levels: 4 in 10 a leaf (`opts[:leaf]`, a function of no
  argument), 1 in 10 each a list of 1 to 5 terms, a map of 1 to 4 pairs keyed by
  `opts[:key]`, a tuple of 0 to 4 terms, and 3 in 10 one of `opts[:extras]` (functions
  of the generator of one level less; a leaf when there are none).
  """
  def nested(0, opts), do: opts[:leaf].()

  def nested(depth, opts) do
    sub = fn -> nested(depth - 1, opts) end

    case {:rand.uniform(10), Keyword.get(opts, :extras, [])} do
      {n, _} when n <= 4 -> opts[:leaf].()
      {5, _} -> for _ <- 1..:rand.uniform(5), do: sub.()
      {6, _} -> Map.new(1..:rand.uniform(4), fn _ -> {opts[:key].(), sub.()} end)
      {7, _} -> List.to_tuple(for _ <- 1..(:rand.uniform(5) - 1)//1, do: sub.())
      {_, []} -> opts[:leaf].()
      {_, extras} -> Enum.random(extras).(sub)
    end
  end
end
