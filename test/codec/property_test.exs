defmodule VllmBridge.CodecTest.Pair do
  @moduledoc false
  defstruct [:left, :right]
  def __python_class__, do: "tests.property.Pair"
  def __python_fields__, do: [:right, :left]
end

defmodule VllmBridge.Codec.PropertyTest do
  @moduledoc """
  Seeded random terms: every term round trips and re-encodes to the same bytes; truncated,
  mutated and random bytes decode to a value or an error, never a raise.
  """
  use ExUnit.Case, async: true

  import Bitwise
  alias VllmBridge.{Codec, Object, Ref}
  alias VllmBridge.CodecTest.Pair
  alias VllmBridge.TestSupport.TermGen

  @seeds [1, 2, 3, 42, 1234]

  setup_all do
    :ok = VllmBridge.Codec.Registry.register(Pair)
  end

  defp bin(term), do: IO.iodata_to_binary(Codec.encode(term))

  test "random terms round trip and re-encode to the same bytes" do
    for seed <- @seeds do
      :rand.seed(:exsss, {seed, seed, seed})

      for i <- 1..400 do
        term = gen(4)
        bytes = bin(term)
        assert {:ok, back} = Codec.decode(bytes), "seed #{seed} term #{i}: #{inspect(term)}"
        assert back == term, "seed #{seed} term #{i}"
        assert bin(back) == bytes, "seed #{seed} term #{i}: re-encoding differs"
      end
    end
  end

  test "every strict prefix of an encoding is an error" do
    for seed <- @seeds do
      :rand.seed(:exsss, {seed, 7, 7})

      for _ <- 1..60 do
        bytes = bin(gen(3))
        n = byte_size(bytes)

        cuts =
          if n <= 300, do: 0..(n - 1), else: Enum.map(1..300, fn _ -> :rand.uniform(n) - 1 end)

        for cut <- cuts do
          assert {:error, reason} = Codec.decode(binary_part(bytes, 0, cut)),
                 "seed #{seed}: prefix #{cut}/#{n} of #{inspect(bytes, limit: 20)} decoded"

          assert is_binary(reason)
        end
      end
    end
  end

  test "mutated encodings decode to a value or an error, never a raise" do
    for seed <- @seeds do
      :rand.seed(:exsss, {seed, 9, 9})

      for _ <- 1..300 do
        bytes = bin(gen(3))

        for _ <- 1..10 do
          mutated = mutate(bytes)

          assert (case Codec.decode(mutated) do
                    {:ok, _} -> true
                    {:error, reason} -> is_binary(reason)
                  end),
                 "seed #{seed}: #{inspect(mutated, limit: 40)}"
        end
      end
    end
  end

  test "random bytes decode to a value or an error, never a raise" do
    :rand.seed(:exsss, {11, 12, 13})
    # bytes drawn mostly from the type bytes that carry lengths and extensions
    interesting =
      [0xC4, 0xC5, 0xC6, 0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8, 0xD9] ++
        [0xDA, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0x92, 0x93, 0x81, 0xA1, 1, 2, 3, 4, 5, 6, 7, 0xFF, 0]

    for _ <- 1..20_000 do
      bytes =
        for _ <- 1..:rand.uniform(40), into: <<>> do
          if :rand.uniform(2) == 1,
            do: <<Enum.random(interesting)>>,
            else: <<:rand.uniform(256) - 1>>
        end

      result = Codec.decode(bytes)
      assert match?({:ok, _}, result) or match?({:error, reason} when is_binary(reason), result)
    end
  end

  # -- mutation ------------------------------------------------------------------

  defp mutate(<<>>), do: <<:rand.uniform(256) - 1>>

  defp mutate(bytes) do
    pos = :rand.uniform(byte_size(bytes)) - 1
    <<before::binary-size(pos), b, rest::binary>> = bytes

    case :rand.uniform(4) do
      1 -> <<before::binary, bxor(b, 1 <<< (:rand.uniform(8) - 1)), rest::binary>>
      2 -> <<before::binary, :rand.uniform(256) - 1, rest::binary>>
      3 -> <<before::binary, rest::binary>>
      4 -> <<before::binary, b, :rand.uniform(256) - 1, rest::binary>>
    end
  end

  # -- the generator ---------------------------------------------------------------

  defp gen(depth) do
    TermGen.nested(depth,
      leaf: &leaf/0,
      key: &key/0,
      extras: [
        fn sub -> %Pair{left: sub.(), right: sub.()} end,
        &object/1
      ]
    )
  end

  defp object(sub) do
    fields = Map.new(1..:rand.uniform(4), fn i -> {"f#{i}_#{:rand.uniform(9)}", sub.()} end)

    %Object{
      class: "tests.property.Unknown",
      fields: fields,
      field_order: Enum.shuffle(Map.keys(fields))
    }
  end

  # Keys that Python holds distinct too (no "a" beside :a, no 1 beside 1.0 or true): the
  # keys Python would merge are refused by the encoder (see echo_fuzz_test.exs).
  defp key do
    case :rand.uniform(4) do
      1 -> "s" <> string()
      2 -> integer()
      3 -> Enum.random([:a, :b, :num_tokens, :uniform, :ok])
      4 -> {integer(), string()}
    end
  end

  defp leaf do
    case :rand.uniform(12) do
      1 ->
        Enum.random([nil, true, false])

      2 ->
        integer()

      3 ->
        float()

      4 ->
        Enum.random([:nan, :infinity, :neg_infinity])

      5 ->
        string()

      6 ->
        bytes()

      7 ->
        Enum.random([:ok, :error, :full, :"an atom", VllmBridge])

      8 ->
        tensor()

      9 ->
        %Ref{
          instance: hex(16),
          id: :rand.uniform(1000),
          session: Enum.random([nil, "s"]),
          type: "m.T",
          # Decoded, a reference names this node (not on the wire).
          node: node()
        }

      10 ->
        []

      11 ->
        %{}

      12 ->
        {}
    end
  end

  defp integer, do: TermGen.integer()
  defp float, do: TermGen.float()

  defp string do
    # 70 000 characters now and then: the longest str headers.
    len = Enum.random([0, 1, 5, 31, 32, 200, 70_000])
    TermGen.string([if(len == 70_000 and :rand.uniform(20) > 1, do: 3, else: len)])
  end

  defp bytes, do: TermGen.bytes([0, 3, 300])

  defp hex(n), do: Base.encode16(:rand.bytes(div(n, 2)), case: :lower)

  defp tensor, do: TermGen.tensor(3, 3, ["cpu", "cuda:0"])
end
