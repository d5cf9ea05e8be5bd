defmodule VllmBridge.Codec.MsgpackTest do
  @moduledoc "The msgpack layer: every format family, sizes at their boundaries, refusals."
  use ExUnit.Case, async: true

  alias VllmBridge.Codec
  alias VllmBridge.Codec.Msgpack
  alias VllmBridge.Codec.Msgpack.Decoder

  defp bin(term), do: IO.iodata_to_binary(Codec.encode(term))
  defp roundtrip(term), do: Codec.decode(bin(term))

  test "integers at every format boundary round trip, each in its smallest format" do
    cases = [
      {0, 1},
      {127, 1},
      {128, 2},
      {255, 2},
      {256, 3},
      {65_535, 3},
      {65_536, 5},
      {0xFFFFFFFF, 5},
      {0x100000000, 9},
      {0xFFFFFFFFFFFFFFFF, 9},
      {-1, 1},
      {-32, 1},
      {-33, 2},
      {-128, 2},
      {-129, 3},
      {-32_768, 3},
      {-32_769, 5},
      {-0x80000000, 5},
      {-0x80000001, 9},
      {-0x8000000000000000, 9}
    ]

    for {i, size} <- cases do
      assert byte_size(bin(i)) == size, "#{i} should take #{size} bytes"
      assert roundtrip(i) == {:ok, i}
    end
  end

  test "every negative fixint decodes to its value" do
    for b <- 0xE0..0xFF, do: assert(Codec.decode(<<b>>) == {:ok, b - 256})
  end

  test "strings and binaries of every length format" do
    for n <- [0, 31, 32, 255, 256, 65_535, 65_536] do
      s = String.duplicate("x", n)
      assert roundtrip(s) == {:ok, s}
      b = :binary.copy(<<0xFF>>, n)
      assert roundtrip(b) == {:ok, b}
    end

    assert <<0xD9, 32, _::binary>> = bin(String.duplicate("a", 32))
    assert <<0xDA, 256::16, _::binary>> = bin(String.duplicate("a", 256))
    assert <<0xDB, 65_536::32, _::binary>> = bin(String.duplicate("a", 65_536))
    assert <<0xC5, 256::16, _::binary>> = bin(:binary.copy(<<0xFF>>, 256))
    assert <<0xC6, 65_536::32, _::binary>> = bin(:binary.copy(<<0xFF>>, 65_536))
  end

  test "a binary is str exactly when it is valid UTF-8" do
    for s <- ["abc", "é", <<0xF0, 0x9F, 0x98, 0x80>>],
        do: assert(<<0b101::3, _::bitstring>> = bin(s))

    # truncated sequence, lone continuation byte, overlong encoding, UTF-16 surrogate
    for b <- [<<0xC3>>, <<0x80>>, <<0xC0, 0x80>>, <<0xED, 0xA0, 0x80>>],
        do: assert(<<0xC4, _::binary>> = bin(b))
  end

  test "arrays and maps of every length format" do
    for n <- [0, 15, 16, 65_535, 65_536] do
      l = Enum.to_list(1..n//1)
      assert roundtrip(l) == {:ok, l}
      m = Map.new(l, &{&1, &1})
      assert roundtrip(m) == {:ok, m}
    end

    assert <<0xDC, 16::16, _::binary>> = bin(Enum.to_list(1..16))
    assert <<0xDD, 65_536::32, _::binary>> = bin(Enum.to_list(1..65_536))
    assert <<0xDE, 16::16, _::binary>> = bin(Map.new(1..16, &{&1, 0}))
    assert <<0xDF, 65_536::32, _::binary>> = bin(Map.new(1..65_536, &{&1, 0}))
  end

  test "map pairs are written in key order whatever the map's size" do
    for n <- [3, 40, 1000] do
      keys = Enum.shuffle(Enum.map(1..n, &"k#{&1}"))
      m = Enum.reduce(keys, %{}, &Map.put(&2, &1, 0))
      assert decoded_key_order(bin(m)) == Enum.sort(keys)
    end
  end

  # The keys of a map body in wire order (plain msgpack, string keys, int values).
  defp decoded_key_order(body) do
    {n, rest} = Decoder.map_header(body)

    {keys, <<>>} =
      Enum.map_reduce(1..n, rest, fn _, r ->
        {k, r} = Decoder.decode_one(r, Msgpack, 10)
        {_v, r} = Decoder.decode_one(r, Msgpack, 10)
        {k, r}
      end)

    keys
  end

  test "float 32 values decode, specials included" do
    assert Codec.decode(<<0xCA, 1.5::float-32>>) == {:ok, 1.5}
    assert Codec.decode(<<0xCA, 0x7FC00000::32>>) == {:ok, :nan}
    assert Codec.decode(<<0xCA, 0xFF800000::32>>) == {:ok, :neg_infinity}
    assert Codec.decode(<<0xCB, 0x7FF0000000000001::64>>) == {:ok, :nan}
    assert Codec.decode(<<0xCB, 0xFFF8000000000000::64>>) == {:ok, :nan}
  end

  test "floats encode as float 64" do
    assert bin(0.1) == <<0xCB, 0.1::float-64>>
    assert roundtrip(1.0e308) == {:ok, 1.0e308}
    assert roundtrip(5.0e-324) == {:ok, 5.0e-324}
  end

  test "unencodable terms raise ArgumentError naming the value" do
    pid = self()
    e = assert_raise ArgumentError, fn -> Codec.encode([1, %{"a" => pid}]) end
    assert e.message =~ inspect(pid)
    e = assert_raise ArgumentError, fn -> Codec.encode(make_ref()) end
    assert e.message =~ "#Reference"
    e = assert_raise ArgumentError, fn -> Codec.encode(fn -> 1 end) end
    assert e.message =~ "#Function"
    e = assert_raise ArgumentError, fn -> Codec.encode([1, 2 | 3]) end
    assert e.message =~ "improper list [1, 2 | 3]"
    e = assert_raise ArgumentError, fn -> Codec.encode(MapSet.new([1])) end
    assert e.message =~ "MapSet"
  end

  test "plain msgpack carries ext values as tuples and refuses atoms" do
    assert Msgpack.decode(<<0xD5, 1, "ok">>) == {:ok, {:msgpack_ext, 1, "ok"}}
    assert IO.iodata_to_binary(Msgpack.encode({:msgpack_ext, 1, "ok"})) == <<0xD5, 1, "ok">>
    assert_raise ArgumentError, ~r/:foo/, fn -> Msgpack.encode(:foo) end
  end

  describe "malformed input is an error value" do
    test "trailing bytes, empty input, reserved byte" do
      assert {:error, "1 trailing bytes after the value"} = Codec.decode(<<0xC0, 0xC0>>)
      assert {:error, msg} = Codec.decode(<<>>)
      assert msg =~ "ended"
      assert {:error, msg} = Codec.decode(<<0xC1>>)
      assert msg =~ "0xC1"
      assert {:error, msg} = Codec.decode(:not_a_binary)
      assert msg =~ ":not_a_binary"
    end

    test "declared lengths beyond the input fail at once, naming the length" do
      for {bytes, declared} <- [
            {<<0xDB, 0xFFFFFFFF::32, "abc">>, 0xFFFFFFFF},
            {<<0xC6, 0xFFFFFFFF::32>>, 0xFFFFFFFF},
            {<<0xC9, 0xFFFFFFFF::32, 3>>, 0xFFFFFFFF},
            {<<0xDA, 1000::16, "ab">>, 1000},
            {<<0xAA, "abc">>, 10}
          ] do
        assert {:error, msg} = Codec.decode(bytes)
        assert msg =~ "declares #{declared}"
      end

      assert {:error, msg} = Codec.decode(<<0xDD, 0xFFFFFFFF::32, 1, 2, 3>>)
      assert msg =~ "ended"
      assert {:error, _} = Codec.decode(<<0xDF, 0xFFFFFFFF::32>>)
    end

    test "a map that repeats a key" do
      assert {:error, msg} = Codec.decode(<<0x82, 0xA1, "a", 1, 0xA1, "a", 2>>)
      assert msg =~ ~s(repeats the key "a")
      # Python's str "a" and bytes b"a" are two keys there, one binary here
      assert {:error, msg} = Codec.decode(<<0x82, 0xA1, "a", 1, 0xC4, 1, "a", 2>>)
      assert msg =~ ~s(repeats the key "a")
    end

    test "nesting deeper than the limit, while 1000 levels decode" do
      deep = :binary.copy(<<0x91>>, 1000) <> <<0xC0>>
      assert {:ok, [[[_ | _]]]} = Codec.decode(deep)
      assert {:error, msg} = Codec.decode(:binary.copy(<<0x91>>, 100_000) <> <<0xC0>>)
      assert msg =~ "nested deeper than 1024"
    end
  end
end
