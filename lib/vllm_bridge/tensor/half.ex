defmodule VllmBridge.Tensor.Half do
  @moduledoc false
  # IEEE 754 binary16 (`:float16`) and bfloat16 conversions, done on the bits.
  #
  # From a float: round to the nearest representable value, ties to even; beyond the
  # largest finite value, an infinity; below the smallest subnormal, a zero of the same
  # sign. NaN becomes the canonical quiet NaN (`0x7E00`, `0x7FC0`). To a float: exact (every
  # half value is a float 64), with `:nan`, `:infinity` and `:neg_infinity` for the
  # specials.

  import Bitwise

  @typedoc "A float or one of the special values Erlang floats cannot hold."
  @type value :: float() | :nan | :infinity | :neg_infinity

  @doc "The binary16 bits (an integer 0..0xFFFF) nearest to `x`."
  @spec f16_bits(value()) :: 0..0xFFFF
  def f16_bits(x), do: to_bits(x, 5, 10)

  @doc "The bfloat16 bits (an integer 0..0xFFFF) nearest to `x`."
  @spec bf16_bits(value()) :: 0..0xFFFF
  def bf16_bits(x), do: to_bits(x, 8, 7)

  @doc "The value of binary16 bits."
  @spec from_f16_bits(0..0xFFFF) :: value()
  def from_f16_bits(bits), do: from_bits(bits, 5, 10)

  @doc "The value of bfloat16 bits."
  @spec from_bf16_bits(0..0xFFFF) :: value()
  def from_bf16_bits(bits), do: from_bits(bits, 8, 7)

  @doc false
  # The bits of the float format with `eb` exponent bits and `mb` mantissa bits nearest to x.
  @spec to_bits(value(), pos_integer(), pos_integer()) :: non_neg_integer()
  def to_bits(:nan, eb, mb), do: ((1 <<< eb) - 1) <<< mb ||| 1 <<< (mb - 1)
  def to_bits(:infinity, eb, mb), do: ((1 <<< eb) - 1) <<< mb
  def to_bits(:neg_infinity, eb, mb), do: 1 <<< (eb + mb) ||| ((1 <<< eb) - 1) <<< mb

  def to_bits(x, eb, mb) when is_float(x) do
    <<sign::1, e::11, m::52>> = <<x::float-64>>
    # x = sig * 2^(exp - 52)
    {sig, exp} = if e == 0, do: {m, -1022}, else: {m ||| 1 <<< 52, e - 1023}
    emin = 2 - (1 <<< (eb - 1))
    inf = ((1 <<< eb) - 1) <<< mb

    magnitude =
      cond do
        sig == 0 ->
          0

        exp >= emin ->
          # A normal number: 1.mb bits, the carry of the rounding moves into the exponent.
          min(((exp - emin) <<< mb) + round_even(sig, 52 - mb), inf)

        true ->
          # A subnormal in units of 2^(emin - mb); rounding up to 1 <<< mb gives the least
          # normal number, whose bits are the same.
          round_even(sig, 52 - mb + emin - exp)
      end

    sign <<< (eb + mb) ||| magnitude
  end

  @doc false
  # The value of bits of the float format with `eb` exponent bits and `mb` mantissa bits.
  @spec from_bits(non_neg_integer(), pos_integer(), pos_integer()) :: value()
  def from_bits(bits, eb, mb) do
    max_e = (1 <<< eb) - 1
    e = bits >>> mb &&& max_e
    m = bits &&& (1 <<< mb) - 1
    negative = bits >>> (eb + mb) == 1
    bias = (1 <<< (eb - 1)) - 1

    cond do
      e == max_e and m != 0 -> :nan
      e == max_e and negative -> :neg_infinity
      e == max_e -> :infinity
      e == 0 -> signed(m * pow2(1 - bias - mb), negative)
      true -> signed((m ||| 1 <<< mb) * pow2(e - bias - mb), negative)
    end
  end

  # sig / 2^shift rounded to the nearest integer, ties to even.
  defp round_even(_sig, shift) when shift > 60, do: 0

  defp round_even(sig, shift) do
    q = sig >>> shift
    r = sig &&& (1 <<< shift) - 1
    half = 1 <<< (shift - 1)
    if r > half or (r == half and (q &&& 1) == 1), do: q + 1, else: q
  end

  # 2^k as a float, exactly (k within the normal float 64 range).
  defp pow2(k) do
    <<f::float-64>> = <<0::1, k + 1023::11, 0::52>>
    f
  end

  # (-f would lose the sign of a zero: the compiler turns it into 0 - f.)
  defp signed(f, false), do: f
  defp signed(f, true), do: f * -1.0
end
