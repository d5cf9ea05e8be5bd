defmodule VllmBridge.Runtime.EchoFuzzTest do
  @moduledoc """
  10 000 seeded random nested terms (integers of every size, floats, binaries, atoms,
  tuples, lists, maps with mixed keys, tensors, dataclass structs, deep chains) through
  `vllm_bridge.diag.echo` on a real worker: each comes back equal (`===`), or is refused
  with `:bad_argument`, never changed.

  The refusals are checked against Python itself: a term the Elixir side refuses for its
  map keys is sent anyway, encoded without the check, and the worker must refuse it too
  (so Elixir refuses exactly what Python could not take as sent); a term refused for its
  depth nests deeper than `VllmBridge.Codec.max_depth/0`.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import Bitwise
  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Bytes, Error, Request, Tensor, Wire}
  alias VllmBridge.Codec.Msgpack
  alias Vllm.ForwardContext.BatchDescriptor

  @pool :rt_echo_fuzz
  @terms 10_000
  @max Msgpack.max_depth()

  defmodule Unchecked do
    @moduledoc false
    def encode_other(term, _h, depth),
      do: VllmBridge.Codec.Ext.encode_other(term, __MODULE__, depth)

    def check_keys(_pairs), do: :ok
  end

  setup_all do
    start_pool!(@pool, size: 1)
    [w] = workers!(@pool)
    %{w: w}
  end

  test "random terms come back equal or are refused as Python would", %{w: w} do
    :rand.seed(:exsss, {13, 7, 2026})

    counts =
      Enum.reduce(1..@terms, %{equal: 0, keys: 0, depth: 0}, fn i, counts ->
        term = if rem(i, 50) == 0, do: deep_chain(), else: gen(4)

        case VllmBridge.call({"vllm_bridge.diag", "echo"}, [term], %{}, pool_name: @pool) do
          {:ok, back} ->
            assert back === expected(term),
                   "term #{i} changed: #{inspect(term)} -> #{inspect(back)}"

            Map.update!(counts, :equal, &(&1 + 1))

          {:error, %Error{type: :bad_argument, message: "args[0]: " <> why}} ->
            if why =~ "nested deeper than #{@max} levels" do
              assert depth(term) > @max, "term #{i} refused for depth: #{inspect(term)}"
              Map.update!(counts, :depth, &(&1 + 1))
            else
              assert why =~ ~r/the map keys? .* (are equal in Python|Python cannot hash)/
              assert {:error, %Error{type: :bad_argument, message: py}} = raw_echo(w.pid, term)
              assert py =~ "could not decode args[0]"
              Map.update!(counts, :keys, &(&1 + 1))
            end

          other ->
            flunk("term #{i}: #{inspect(term, limit: 20)} gave #{inspect(other)}")
        end
      end)

    # Every class was exercised, and most terms travel.
    assert counts.equal > 8_000 and counts.keys > 100 and counts.depth > 50, inspect(counts)
  end

  defp raw_echo(pid, term) do
    args = [0x91 | Msgpack.encode(term, Unchecked, 2000)]
    parts = [Wire.value(["m", "vllm_bridge.diag", "echo"]), args, Wire.value(%{})]
    deadline = System.monotonic_time(:millisecond) + 30_000
    Request.call(pid, Request.new("call", [Wire.value(nil)], true, parts), deadline, false)
  end

  # What comes back: %Bytes{} is how Elixir asks for msgpack bin; it returns as a binary.
  defp expected(%Bytes{data: d}), do: d
  defp expected(%Tensor{} = t), do: t
  defp expected(%BatchDescriptor{} = b), do: b
  defp expected(l) when is_list(l), do: Enum.map(l, &expected/1)

  defp expected(t) when is_tuple(t),
    do: t |> Tuple.to_list() |> Enum.map(&expected/1) |> List.to_tuple()

  defp expected(m) when is_map(m), do: Map.new(m, fn {k, v} -> {expected(k), expected(v)} end)
  defp expected(x), do: x

  defp depth(l) when is_list(l), do: 1 + Enum.reduce(l, 0, &max(depth(&1), &2))
  defp depth(t) when is_tuple(t), do: depth(Tuple.to_list(t))
  defp depth(%BatchDescriptor{}), do: 1
  defp depth(%_{}), do: 0

  defp depth(m) when is_map(m),
    do: 1 + Enum.reduce(m, 0, fn {k, v}, acc -> max(acc, max(depth(k), depth(v))) end)

  defp depth(_), do: 0

  # -- the generator ---------------------------------------------------------------------

  defp gen(0), do: leaf()

  defp gen(depth) do
    case :rand.uniform(10) do
      n when n <= 4 -> leaf()
      5 -> for _ <- 1..:rand.uniform(5)//1, do: gen(depth - 1)
      6 -> []
      7 -> Map.new(1..:rand.uniform(4), fn _ -> {key(), gen(depth - 1)} end)
      8 -> List.to_tuple(for _ <- 1..(:rand.uniform(4) - 1)//1, do: gen(depth - 1))
      9 -> Map.new(1..:rand.uniform(3), fn _ -> {string(), gen(depth - 1)} end)
      10 -> descriptor()
    end
  end

  # A chain of 60 to 70 containers of every kind (the limit is 64).
  defp deep_chain do
    wrappers = [&[&1], &%{"k" => &1}, &{&1}, &%{1 => &1}]
    Enum.reduce(1..(59 + :rand.uniform(11)), leaf(), fn _, acc -> Enum.random(wrappers).(acc) end)
  end

  # Keys drawn so that some maps hold keys Python merges (1 and true, 1 and 1.0, :a and
  # "a", tuples of those) and a few hold keys Python cannot hash.
  @keys [
    0,
    1,
    2,
    true,
    false,
    1.0,
    -0.0,
    2.5,
    :a,
    "a",
    :b,
    "b",
    nil,
    "nil",
    {1, "a"},
    {true, :a},
    <<0xFF>>,
    1 <<< 70,
    (1 <<< 70) * 1.0,
    :nan,
    :infinity
  ]
  @unhashable [[1], %{}, {1, [2]}, %{"x" => 1}]

  defp key do
    case :rand.uniform(40) do
      1 -> Enum.random(@unhashable)
      n when n <= 20 -> Enum.random(@keys)
      n when n <= 30 -> integer()
      _ -> string()
    end
  end

  defp leaf do
    case :rand.uniform(11) do
      1 -> Enum.random([nil, true, false])
      2 -> integer()
      3 -> float()
      4 -> Enum.random([:nan, :infinity, :neg_infinity, -0.0, 1.0, 1.0e20])
      5 -> string()
      6 -> <<0xFF, :rand.bytes(Enum.random([0, 3, 40]))::binary>>
      7 -> %Bytes{data: string()}
      8 -> Enum.random([:ok, :error, :full, :"an atom", :a])
      9 -> tensor()
      10 -> descriptor()
      11 -> {}
    end
  end

  defp integer do
    bits = Enum.random([1, 4, 7, 8, 15, 16, 31, 32, 63, 64, 65, 100, 300])
    n = :rand.uniform(1 <<< bits) - 1
    if :rand.uniform(2) == 1, do: n, else: -n
  end

  # Any finite float: random bits with the exponent kept below the NaN/inf one.
  defp float do
    <<f::float-64>> =
      <<:rand.uniform(2) - 1::1, :rand.uniform(0x7FF) - 1::11, :rand.uniform(1 <<< 52) - 1::52>>

    f
  end

  defp string do
    len = Enum.random([0, 1, 2, 5, 33])

    for _ <- 1..len//1,
        into: "",
        do: <<Enum.random([?a, ?b, ?Z, ?0, 0xE9, 0x2713, 0x1F600])::utf8>>
  end

  defp tensor do
    dtype = Enum.random(Tensor.dtypes())
    shape = for _ <- 1..(:rand.uniform(3) - 1)//1, do: :rand.uniform(3) - 1
    n = Enum.reduce(shape, 1, &(&1 * &2)) * Tensor.itemsize(dtype)
    data = :rand.bytes(n)
    data = if dtype == :bool, do: for(<<b <- data>>, into: <<>>, do: <<b &&& 1>>), else: data
    Tensor.new(data, dtype, shape)
  end

  defp descriptor do
    %BatchDescriptor{
      num_tokens: :rand.uniform(512) - 1,
      num_reqs: Enum.random([nil, :rand.uniform(64)]),
      uniform: :rand.uniform(2) == 1,
      has_lora: :rand.uniform(2) == 1,
      num_active_loras: :rand.uniform(4) - 1
    }
  end
end
