defmodule VllmBridge.Codec.HalfTest do
  @moduledoc "float16 / bfloat16 conversions: exhaustive over the bits, nearest-value property."
  use ExUnit.Case, async: true

  import Bitwise
  alias VllmBridge.Tensor.Half

  @formats [
    {"float16", &Half.f16_bits/1, &Half.from_f16_bits/1, 0x7C00},
    {"bfloat16", &Half.bf16_bits/1, &Half.from_bf16_bits/1, 0x7F80}
  ]

  # The largest finite value plus half an ulp: from there on, a value rounds to infinity.
  @overflow %{"float16" => 65_520.0, "bfloat16" => (2 - :math.pow(2, -8)) * :math.pow(2, 127)}

  test "every bit pattern converts to a value and back to the same bits (NaNs to :nan)" do
    for {name, to_bits, from_bits, inf} <- @formats, bits <- 0..0xFFFF do
      value = from_bits.(bits)
      nan? = (bits &&& 0x7FFF) > inf

      cond do
        nan? ->
          assert value == :nan, "#{name} #{bits} should be NaN"

        is_float(value) ->
          # the float's own sign bit matches (so -0.0 really is negative)
          <<sign::1, _::63>> = <<value::float-64>>
          assert sign == bits >>> 15, "#{name} #{bits} -> #{inspect(value)} lost its sign"
          assert to_bits.(value) == bits, "#{name} #{bits} -> #{value} does not come back"

        true ->
          assert to_bits.(value) == bits, "#{name} #{bits} -> #{value} does not come back"
      end
    end
  end

  test "canonical NaN and the infinities" do
    assert Half.f16_bits(:nan) == 0x7E00
    assert Half.bf16_bits(:nan) == 0x7FC0
    assert Half.f16_bits(:neg_infinity) == 0xFC00
    assert Half.bf16_bits(:infinity) == 0x7F80
    assert Half.from_f16_bits(0xFC00) == :neg_infinity
  end

  test "random floats convert to the nearest representable value, ties to even" do
    :rand.seed(:exsss, {5, 6, 7})

    for {name, to_bits, from_bits, inf} <- @formats, _ <- 1..20_000 do
      x = random_float()
      bits = to_bits.(x)
      sign = bits &&& 0x8000
      mag = bits &&& 0x7FFF
      assert mag <= inf, "#{name}(#{x}) gave NaN bits #{bits}"

      if mag == inf do
        assert abs(x) >= @overflow[name], "#{name}(#{x}) overflowed too early"
      else
        assert abs(x) < @overflow[name], "#{name}(#{x}) should overflow"
      end

      # |x - value| is no more than to either finite neighbour of the same sign
      err = distance(x, from_bits.(bits))

      for n <- [mag - 1, mag + 1], n >= 0 and n < inf and mag < inf do
        other = distance(x, from_bits.(sign ||| n))
        assert err <= other, "#{name}(#{x}) = #{bits}, but #{sign ||| n} is nearer"

        if err == other and err != :infinity,
          do: assert((mag &&& 1) == 0, "#{name}(#{x}): a tie must go to the even neighbour")
      end
    end
  end

  # Magnitudes from far below the subnormals to beyond the range, exact ties included.
  defp random_float do
    case :rand.uniform(3) do
      1 ->
        (:rand.uniform() - 0.5) * :math.pow(2, :rand.uniform(300) - 150)

      2 ->
        # a value on a 2^-k grid, so exact halfway points come up often
        (:rand.uniform(1 <<< 20) - (1 <<< 19)) * :math.pow(2, -(:rand.uniform(150) - 10))

      3 ->
        <<f::float-64>> = <<0::2, :rand.uniform(1 <<< 62) - 1::62>>
        if :rand.uniform(2) == 1, do: f, else: -f
    end
  end

  defp distance(_x, v) when v in [:infinity, :neg_infinity], do: :infinity
  defp distance(x, v), do: abs(x - v)
end
