defmodule VllmBridge.Tensor.Elements do
  @moduledoc false
  # Tensor elements to and from their little-endian bytes, per dtype (see
  # `VllmBridge.Tensor` for how elements look in Elixir).

  alias VllmBridge.Tensor
  alias VllmBridge.Tensor.Half

  # dtype => {least, greatest, bits}
  @int_ranges %{
    uint8: {0, 0xFF, 8},
    uint16: {0, 0xFFFF, 16},
    uint32: {0, 0xFFFFFFFF, 32},
    uint64: {0, 0xFFFFFFFFFFFFFFFF, 64},
    int8: {-0x80, 0x7F, 8},
    int16: {-0x8000, 0x7FFF, 16},
    int32: {-0x80000000, 0x7FFFFFFF, 32},
    int64: {-0x8000000000000000, 0x7FFFFFFFFFFFFFFF, 64}
  }

  @doc "Packs a flat list of elements; raises `ArgumentError` naming an element that does not fit."
  @spec pack([Tensor.element()], Tensor.dtype()) :: binary()
  def pack(values, dtype), do: Enum.reduce(values, <<>>, &append(&2, &1, dtype))

  @doc """
  Packs a nested list whose nesting must be `shape`; raises `ArgumentError` naming the list
  that breaks it or an element that does not fit.
  """
  @spec pack_nested(term(), [non_neg_integer()], Tensor.dtype()) :: binary()
  def pack_nested(values, shape, dtype), do: walk(values, shape, dtype, <<>>)

  defp walk(values, [n | rest], dtype, acc) when is_list(values) and length(values) == n,
    do: Enum.reduce(values, acc, &walk(&1, rest, dtype, &2))

  defp walk(value, [], dtype, acc) when not is_list(value), do: append(acc, value, dtype)

  defp walk(value, shape, _dtype, _acc) do
    raise ArgumentError,
          "ragged nested list: expected #{describe(shape)}, got #{inspect(value, limit: 5)}"
  end

  defp describe([]), do: "an element"
  defp describe(shape), do: "a list nested as shape #{inspect(shape)}"

  @doc "Unpacks the bytes of `dtype` elements into a flat list."
  @spec unpack(binary(), Tensor.dtype()) :: [Tensor.element()]
  def unpack(data, :bool), do: for(<<b <- data>>, do: b != 0)
  def unpack(data, :uint8), do: for(<<x::little-unsigned-8 <- data>>, do: x)
  def unpack(data, :uint16), do: for(<<x::little-unsigned-16 <- data>>, do: x)
  def unpack(data, :uint32), do: for(<<x::little-unsigned-32 <- data>>, do: x)
  def unpack(data, :uint64), do: for(<<x::little-unsigned-64 <- data>>, do: x)
  def unpack(data, :int8), do: for(<<x::little-signed-8 <- data>>, do: x)
  def unpack(data, :int16), do: for(<<x::little-signed-16 <- data>>, do: x)
  def unpack(data, :int32), do: for(<<x::little-signed-32 <- data>>, do: x)
  def unpack(data, :int64), do: for(<<x::little-signed-64 <- data>>, do: x)
  def unpack(data, :float16), do: for(<<b::little-16 <- data>>, do: Half.from_f16_bits(b))
  def unpack(data, :bfloat16), do: for(<<b::little-16 <- data>>, do: Half.from_bf16_bits(b))
  def unpack(data, :float32), do: f32s(data, [])
  def unpack(data, :float64), do: f64s(data, [])
  def unpack(data, :complex64), do: pairs(f32s(data, []))
  def unpack(data, :complex128), do: pairs(f64s(data, []))

  # A binary comprehension would silently skip the NaN and infinity bit patterns, which do
  # not match a float segment: hence the explicit loops.
  defp f32s(<<x::little-float-32, rest::binary>>, acc), do: f32s(rest, [x | acc])

  defp f32s(<<b::little-32, rest::binary>>, acc),
    do: f32s(rest, [Half.from_bits(b, 8, 23) | acc])

  defp f32s(<<>>, acc), do: :lists.reverse(acc)

  defp f64s(<<x::little-float-64, rest::binary>>, acc), do: f64s(rest, [x | acc])

  defp f64s(<<b::little-64, rest::binary>>, acc),
    do: f64s(rest, [Half.from_bits(b, 11, 52) | acc])

  defp f64s(<<>>, acc), do: :lists.reverse(acc)

  defp pairs([re, im | rest]), do: [{re, im} | pairs(rest)]
  defp pairs([]), do: []

  # -- packing one element -------------------------------------------------------

  defp append(acc, true, :bool), do: <<acc::binary, 1>>
  defp append(acc, false, :bool), do: <<acc::binary, 0>>

  for {dtype, {lo, hi, size}} <- @int_ranges do
    defp append(acc, x, unquote(dtype))
         when is_integer(x) and x >= unquote(lo) and x <= unquote(hi),
         do: <<acc::binary, x::little-size(unquote(size))>>
  end

  defp append(acc, x, :float16),
    do: <<acc::binary, Half.f16_bits(float!(x, :float16))::little-16>>

  defp append(acc, x, :bfloat16),
    do: <<acc::binary, Half.bf16_bits(float!(x, :bfloat16))::little-16>>

  defp append(acc, x, :float32), do: f32(acc, float!(x, :float32))
  defp append(acc, x, :float64), do: f64(acc, float!(x, :float64))

  defp append(acc, {re, im}, :complex64),
    do: acc |> f32(float!(re, :complex64)) |> f32(float!(im, :complex64))

  defp append(acc, {re, im}, :complex128),
    do: acc |> f64(float!(re, :complex128)) |> f64(float!(im, :complex128))

  defp append(acc, x, complex) when complex in [:complex64, :complex128] and not is_tuple(x),
    do: append(acc, {x, 0.0}, complex)

  defp append(_acc, x, dtype) do
    raise ArgumentError, "#{inspect(x, limit: 5)} is not a #{dtype} element#{hint(x, dtype)}"
  end

  defp hint(x, dtype) when is_integer(x) and is_map_key(@int_ranges, dtype) do
    {lo, hi, _bits} = @int_ranges[dtype]
    " (out of the range #{lo}..#{hi})"
  end

  defp hint(_x, :bool), do: " (true or false)"
  defp hint(_x, _dtype), do: ""

  defp f32(acc, x) when is_float(x), do: <<acc::binary, x::little-float-32>>
  defp f32(acc, special), do: <<acc::binary, Half.to_bits(special, 8, 23)::little-32>>

  defp f64(acc, x) when is_float(x), do: <<acc::binary, x::little-float-64>>
  defp f64(acc, special), do: <<acc::binary, Half.to_bits(special, 11, 52)::little-64>>

  # A float element: floats, integers (converted) and the three special atoms.
  defp float!(x, _dtype) when is_float(x), do: x
  defp float!(x, _dtype) when x in [:nan, :infinity, :neg_infinity], do: x

  defp float!(x, dtype) when is_integer(x) do
    :erlang.float(x)
  rescue
    ArgumentError ->
      reraise ArgumentError,
              "integer #{x} is beyond the float 64 range of a #{dtype} element",
              __STACKTRACE__
  end

  defp float!(x, dtype),
    do: raise(ArgumentError, "#{inspect(x, limit: 5)} is not a #{dtype} element")
end
