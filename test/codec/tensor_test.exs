defmodule VllmBridge.Codec.TensorTest do
  @moduledoc "VllmBridge.Tensor (new, from_list, to_list) and its wire form (ext 3)."
  use ExUnit.Case, async: true

  alias VllmBridge.{Codec, Tensor}

  defp bin(term), do: IO.iodata_to_binary(Codec.encode(term))
  defp roundtrip(term), do: Codec.decode(bin(term))

  test "dtypes/0 lists the protocol's table in wire-code order, with item sizes" do
    assert Tensor.dtypes() == [
             :bool,
             :uint8,
             :int8,
             :int16,
             :int32,
             :int64,
             :float16,
             :bfloat16,
             :float32,
             :float64,
             :complex64,
             :complex128,
             :uint16,
             :uint32,
             :uint64
           ]

    assert Enum.map(Tensor.dtypes(), &Tensor.itemsize/1) ==
             [1, 1, 1, 2, 4, 8, 2, 2, 4, 8, 8, 16, 2, 4, 8]

    for {dtype, code} <- Enum.with_index(Tensor.dtypes()) do
      t = Tensor.new(:binary.copy(<<0>>, Tensor.itemsize(dtype)), dtype, [1])
      assert <<_ext::binary-3, ^code, 1, 0, 1::64, _::binary>> = bin(t)
    end
  end

  describe "new/4" do
    test "builds from a binary, without copying it" do
      data = :binary.copy(<<1, 2, 3, 4>>, 100)
      t = Tensor.new(data, :int32, [10, 10], device: "cuda:1")
      assert %Tensor{dtype: :int32, shape: [10, 10], device: "cuda:1"} = t
      assert :erts_debug.same(t.data, data)
      assert Tensor.size(t) == 100
      assert Tensor.nbytes(t) == 400
      assert Tensor.size(Tensor.new(<<1>>, :bool, [])) == 1
    end

    test "refuses a data size that does not match the shape, naming both" do
      e = assert_raise ArgumentError, fn -> Tensor.new(<<0::8*10>>, :float32, [2, 3]) end

      assert e.message ==
               "tensor data is 10 bytes but shape [2, 3] of float32 (4 bytes each) needs 24"
    end

    test "refuses an unknown dtype, a bad shape or a bad device" do
      assert_raise ArgumentError, ~r/unknown tensor dtype :float8/, fn ->
        Tensor.new(<<>>, :float8, [0])
      end

      assert_raise ArgumentError, ~r/\[2, -1\]/, fn -> Tensor.new(<<>>, :int8, [2, -1]) end
      assert_raise ArgumentError, ~r/:x/, fn -> Tensor.new(<<>>, :int8, :x) end
      assert_raise ArgumentError, ~r/device/, fn -> Tensor.new(<<>>, :int8, [0], device: :cpu) end
    end
  end

  describe "from_list/3 and to_list/1" do
    test "integer dtypes at their bounds" do
      for {dtype, lo, hi} <- [
            {:uint8, 0, 255},
            {:int8, -128, 127},
            {:int16, -32_768, 32_767},
            {:uint16, 0, 65_535},
            {:int32, -0x80000000, 0x7FFFFFFF},
            {:uint32, 0, 0xFFFFFFFF},
            {:int64, -0x8000000000000000, 0x7FFFFFFFFFFFFFFF},
            {:uint64, 0, 0xFFFFFFFFFFFFFFFF}
          ] do
        values = [[lo, hi], [0, 1]]
        t = Tensor.from_list(values, dtype)
        assert t.shape == [2, 2]
        assert Tensor.to_list(t) == values
        assert roundtrip(t) == {:ok, t}

        e = assert_raise ArgumentError, fn -> Tensor.from_list([hi + 1], dtype) end
        assert e.message == "#{hi + 1} is not a #{dtype} element (out of the range #{lo}..#{hi})"

        assert_raise ArgumentError, ~r/#{lo - 1} is not/, fn ->
          Tensor.from_list([lo - 1], dtype)
        end

        assert_raise ArgumentError, ~r/1.5 is not a #{dtype}/, fn ->
          Tensor.from_list([1.5], dtype)
        end
      end
    end

    test "data is little-endian and C-contiguous" do
      t = Tensor.from_list([[1, 2, 3], [4, 5, 6]], :int16)
      assert t.data == <<1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0>>
      assert Tensor.to_flat_list(t) == [1, 2, 3, 4, 5, 6]

      <<1, 0, 0, 0>>
    end

    test "bool" do
      t = Tensor.from_list([true, false, true], :bool)
      assert t.data == <<1, 0, 1>>
      assert Tensor.to_list(t) == [true, false, true]

      e = assert_raise ArgumentError, fn -> Tensor.new(<<0, 1, 1, 2, 255>>, :bool, [5]) end
      assert e.message =~ "holds the byte 2 at offset 3; bool bytes must be 0 or 1"

      # found in any chunk of a large tensor, at its exact offset
      n = 200_000

      for at <- [0, 65_535, 65_536, 131_077, n - 1] do
        data = :binary.copy(<<1>>, at) <> <<0x80>> <> :binary.copy(<<0>>, n - at - 1)
        assert VllmBridge.Tensor.bad_bool_byte(data) == {at, 0x80}
      end

      assert VllmBridge.Tensor.bad_bool_byte(:binary.copy(<<1, 0>>, n)) == nil

      assert_raise ArgumentError, ~r/the byte 7 at offset 0/, fn ->
        Codec.encode(%Tensor{dtype: :bool, shape: [1], data: <<7>>})
      end

      assert_raise ArgumentError, ~r/1 is not a bool element \(true or false\)/, fn ->
        Tensor.from_list([1], :bool)
      end
    end

    test "float32 and float64, specials and integers included" do
      for dtype <- [:float32, :float64] do
        values = [1.5, -0.25, 0.0, :nan, :infinity, :neg_infinity, 3]
        t = Tensor.from_list(values, dtype)
        assert Tensor.to_list(t) == [1.5, -0.25, 0.0, :nan, :infinity, :neg_infinity, 3.0]
        assert roundtrip(t) == {:ok, t}

        assert_raise ArgumentError, ~r/"x" is not a #{dtype}/, fn ->
          Tensor.from_list(["x"], dtype)
        end
      end

      # float32 rounds to nearest and overflows to infinity
      assert Tensor.to_list(Tensor.from_list([0.1, 1.0e39, -1.0e39], :float32)) ==
               [0.10000000149011612, :infinity, :neg_infinity]

      assert_raise ArgumentError, ~r/beyond the float 64 range/, fn ->
        Tensor.from_list([Integer.pow(10, 400)], :float64)
      end
    end

    test "specials in the data are never dropped by to_list" do
      data = <<1.0::little-float-32, 0x7FC00001::little-32, 0xFF800000::little-32>>
      assert Tensor.to_list(Tensor.new(data, :float32, [3])) == [1.0, :nan, :neg_infinity]
      data = <<0x7FF0000000000000::little-64, 2.0::little-float-64>>
      assert Tensor.to_list(Tensor.new(data, :float64, [2])) == [:infinity, 2.0]
    end

    test "complex dtypes as {re, im} tuples; a plain number is its real part" do
      for dtype <- [:complex64, :complex128] do
        t = Tensor.from_list([{1.0, -2.0}, 3, {:nan, 0.5}], dtype)
        assert t.data |> byte_size() == 3 * Tensor.itemsize(dtype)
        assert Tensor.to_list(t) == [{1.0, -2.0}, {3.0, 0.0}, {:nan, 0.5}]
        assert roundtrip(t) == {:ok, t}
      end
    end

    test "float16 and bfloat16 round trip their special values" do
      specials = [0.0, -0.0, 1.0, -2.0, 0.5, :nan, :infinity, :neg_infinity]

      for dtype <- [:float16, :bfloat16] do
        t = Tensor.from_list(specials, dtype)
        assert Tensor.to_list(t) == specials
        assert roundtrip(t) == {:ok, t}
      end

      f16 = Tensor.from_list([65_504.0, 5.960464477539063e-8, :nan, -0.0, :infinity], :float16)

      assert f16.data ==
               <<0x7BFF::little-16, 0x0001::little-16, 0x7E00::little-16, 0x8000::little-16,
                 0x7C00::little-16>>

      bf16 = Tensor.from_list([1.0, -6.0, :nan, 3.3895313892515355e38], :bfloat16)

      assert bf16.data ==
               <<0x3F80::little-16, 0xC0C0::little-16, 0x7FC0::little-16, 0x7F7F::little-16>>
    end

    test "float16 and bfloat16 round to nearest, ties to even, and overflow to infinity" do
      ulp16 = :math.pow(2, -10)
      ulpbf = :math.pow(2, -7)

      for {x, expected} <- [
            {1.0 + ulp16 / 2, 1.0},
            {1.0 + 3 * ulp16 / 2, 1.0 + 2 * ulp16},
            {1.0 + ulp16 / 2 + 1.0e-12, 1.0 + ulp16},
            {65_519.99, 65_504.0},
            {65_520.0, :infinity},
            {-1.0e6, :neg_infinity},
            {:math.pow(2, -25), 0.0},
            {:math.pow(2, -25) * 1.5, :math.pow(2, -24)},
            {1.0e-10, 0.0}
          ] do
        assert Tensor.to_list(Tensor.from_list(x, :float16)) == expected, "float16 of #{x}"
      end

      for {x, expected} <- [
            {1.0 + ulpbf / 2, 1.0},
            {1.0 + 3 * ulpbf / 2, 1.0 + 2 * ulpbf},
            {1.0e39, :infinity},
            {:math.pow(2, -134), 0.0},
            {:math.pow(2, -133) * 1.5, :math.pow(2, -132)}
          ] do
        assert Tensor.to_list(Tensor.from_list(x, :bfloat16)) == expected, "bfloat16 of #{x}"
      end
    end

    test "nested shapes, scalars and empty tensors" do
      t = Tensor.from_list([[[1], [2]], [[3], [4]], [[5], [6]]], :int8)
      assert t.shape == [3, 2, 1]
      assert Tensor.to_list(t) == [[[1], [2]], [[3], [4]], [[5], [6]]]

      s = Tensor.from_list(2.5, :float64)
      assert s.shape == []
      assert Tensor.to_list(s) == 2.5

      for {values, shape} <- [{[], [0]}, {[[], []], [2, 0]}] do
        e = Tensor.from_list(values, :float32)
        assert e.shape == shape and e.data == <<>>
        assert Tensor.to_list(e) == values
      end

      assert Tensor.to_list(Tensor.new(<<>>, :int32, [0, 3])) == []
      assert Tensor.to_list(Tensor.new(<<>>, :int32, [3, 0, 2])) == [[], [], []]
    end

    test "a flat list with the :shape option" do
      t = Tensor.from_list([1, 2, 3, 4, 5, 6], :uint8, shape: [3, 2], device: "cuda:0")
      assert t.device == "cuda:0"
      assert Tensor.to_list(t) == [[1, 2], [3, 4], [5, 6]]
      assert Tensor.from_list(7, :uint8, shape: []).data == <<7>>

      assert_raise ArgumentError, "5 values do not fill shape [3, 2] (6 elements)", fn ->
        Tensor.from_list([1, 2, 3, 4, 5], :uint8, shape: [3, 2])
      end
    end

    test "a ragged list is refused, naming the part that breaks the shape" do
      e = assert_raise ArgumentError, fn -> Tensor.from_list([[1, 2], [3]], :int32) end
      assert e.message == "ragged nested list: expected a list nested as shape [2], got [3]"
      e = assert_raise ArgumentError, fn -> Tensor.from_list([[1, 2], 3], :int32) end
      assert e.message =~ "got 3"
      e = assert_raise ArgumentError, fn -> Tensor.from_list([1, [2]], :int32) end
      assert e.message == "ragged nested list: expected an element, got [2]"
    end
  end

  describe "wire form (ext 3)" do
    test "big tensors are not copied: encode hands over the data, decode gives a sub-binary" do
      data = :binary.copy(<<1, 2, 3, 4>>, 4 * 1024 * 1024)
      t = Tensor.new(data, :float32, [1024, 4096])
      iodata = Codec.encode(t)
      assert [_header, _head | tail] = iodata
      assert :erts_debug.same(tail, data)

      frame = IO.iodata_to_binary(iodata)
      assert {:ok, %Tensor{data: decoded} = back} = Codec.decode(frame)
      assert back == t
      assert :binary.referenced_byte_size(decoded) == byte_size(frame)
    end

    test "every dtype round trips, any device" do
      for dtype <- Tensor.dtypes(),
          shape <- [[], [0], [3], [2, 3]],
          device <- ["cpu", "cuda:3"] do
        n = Enum.reduce(shape, 1, &(&1 * &2)) * Tensor.itemsize(dtype)
        data = if dtype == :bool, do: :binary.copy(<<1>>, n), else: :rand.bytes(n)
        t = Tensor.new(data, dtype, shape, device: device)
        assert roundtrip(t) == {:ok, t}
        assert roundtrip({t, %{"t" => [t]}}) == {:ok, {t, %{"t" => [t]}}}
      end
    end

    test "an inconsistent struct raises on encode, naming the mismatch" do
      assert_raise ArgumentError, ~r/tensor data is 3 bytes but shape \[1\] of int32/, fn ->
        Codec.encode(%Tensor{dtype: :int32, shape: [1], data: <<1, 2, 3>>})
      end

      assert_raise ArgumentError, ~r/over 255 bytes/, fn ->
        Codec.encode(%Tensor{
          dtype: :int8,
          shape: [0],
          data: <<>>,
          device: String.duplicate("d", 256)
        })
      end

      assert_raise ArgumentError, ~r/255/, fn ->
        Codec.encode(%Tensor{dtype: :int8, shape: List.duplicate(1, 256), data: <<0>>})
      end
    end

    test "bad headers are decode errors" do
      tensor = fn payload -> <<0xC9, byte_size(payload)::32, 3, payload::binary>> end

      cases = [
        {<<99, 0, 0, 1>>, "unknown tensor dtype code 99"},
        {<<8, 1>>, "truncated tensor header"},
        {<<8, 1, 10, "cpu">>, "truncated tensor header"},
        {<<8, 2, 0, 1::64>>, "declares 2 dimensions (16 bytes) but 8 bytes follow"},
        {<<8, 1, 0, 2::64, 0::32>>, "tensor data is 4 bytes but shape [2] of float32 needs 8"},
        {<<1, 2, 0, 0xFFFFFFFFFFFFFFFF::64, 0xFFFFFFFFFFFFFFFF::64>>,
         "but shape [18446744073709551615, 18446744073709551615]"},
        {<<1, 0, 2, 0xFF, 0xFE, 7>>, "device name is not valid UTF-8"},
        {<<0, 1, 0, 3::64, 1, 0, 9>>, "bool tensor data holds the byte 9 at offset 2"}
      ]

      for {payload, msg} <- cases do
        assert {:error, reason} = Codec.decode(tensor.(payload))
        assert reason =~ msg
      end
    end
  end
end
