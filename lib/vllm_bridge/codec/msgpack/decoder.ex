defmodule VllmBridge.Codec.Msgpack.Decoder do
  @moduledoc false
  # Decoding for VllmBridge.Codec.Msgpack (see its moduledoc): never raises and never
  # allocates from a declared length (every length is checked against the bytes actually
  # present; binaries come out as sub-binaries of the input), nesting is limited to 1024
  # levels, and malformed input is `{:error, reason}`. Extension payloads go to the
  # handler's `decode_ext/3`, which may use the helpers here (`decode_exact/3`,
  # `decode_one/3`, `array_header/1`, `map_header/1`, `fail!/1`).

  import Bitwise

  # How deeply values may nest (replies from a worker).
  @max_depth 1024

  @doc false
  # Decodes one value spanning the whole binary, extension payloads going to `handler`.
  @spec decode(binary(), module()) :: {:ok, term()} | {:error, String.t()}
  def decode(bin, handler) when is_binary(bin) do
    case dec(bin, handler, @max_depth) do
      {value, <<>>} -> {:ok, value}
      {_value, rest} -> {:error, "#{byte_size(rest)} trailing bytes after the value"}
    end
  catch
    :throw, {__MODULE__, reason} ->
      {:error, reason}

    kind, reason ->
      # Not reached by any input we know of; kept so that decode never raises.
      {:error, "malformed msgpack (#{kind}: #{inspect(reason, limit: 3, printable_limit: 40)})"}
  end

  def decode(other, _handler),
    do: {:error, "expected a binary to decode, got #{inspect(other, limit: 3)}"}

  @doc false
  # Decodes a value that must span all of `bin` (an extension payload); throws on error.
  @spec decode_exact(binary(), module(), non_neg_integer()) :: term()
  def decode_exact(bin, handler, depth) do
    case dec(bin, handler, depth) do
      {value, <<>>} -> value
      {_value, rest} -> fail!("#{byte_size(rest)} trailing bytes in an extension payload")
    end
  end

  @doc false
  # Decodes the first value of `bin`; returns it and the rest. Throws on error.
  @spec decode_one(binary(), module(), non_neg_integer()) :: {term(), binary()}
  def decode_one(bin, handler, depth), do: dec(bin, handler, depth)

  @doc false
  # Reads an array header: the element count and the rest. Throws when there is none.
  @spec array_header(binary()) :: {non_neg_integer(), binary()}
  def array_header(<<0b1001::4, n::4, r::binary>>), do: {n, r}
  def array_header(<<0xDC, n::16, r::binary>>), do: {n, r}
  def array_header(<<0xDD, n::32, r::binary>>), do: {n, r}
  def array_header(_), do: fail!("expected an array")

  @doc false
  # Reads a map header: the pair count and the rest. Throws when there is none.
  @spec map_header(binary()) :: {non_neg_integer(), binary()}
  def map_header(<<0b1000::4, n::4, r::binary>>), do: {n, r}
  def map_header(<<0xDE, n::16, r::binary>>), do: {n, r}
  def map_header(<<0xDF, n::32, r::binary>>), do: {n, r}
  def map_header(_), do: fail!("expected a map")

  @doc false
  # Aborts the decode in progress: `decode/2` returns `{:error, reason}`.
  @spec fail!(String.t()) :: no_return()
  def fail!(reason), do: throw({__MODULE__, reason})

  defp dec(_bin, _h, 0), do: fail!("values nested deeper than #{@max_depth} levels")
  defp dec(<<0::1, i::7, r::binary>>, _h, _d), do: {i, r}
  defp dec(<<0b111::3, _::5, r::binary>> = b, _h, _d), do: {neg_fixint(b), r}
  defp dec(<<0b101::3, n::5, s::binary-size(n), r::binary>>, _h, _d), do: {s, r}
  defp dec(<<0b1001::4, n::4, r::binary>>, h, d), do: dec_list(r, n, [], h, d - 1)
  defp dec(<<0b1000::4, n::4, r::binary>>, h, d), do: dec_map(r, n, n, [], h, d - 1)
  defp dec(<<0xC0, r::binary>>, _h, _d), do: {nil, r}
  defp dec(<<0xC2, r::binary>>, _h, _d), do: {false, r}
  defp dec(<<0xC3, r::binary>>, _h, _d), do: {true, r}
  defp dec(<<0xCC, i::8, r::binary>>, _h, _d), do: {i, r}
  defp dec(<<0xCD, i::16, r::binary>>, _h, _d), do: {i, r}
  defp dec(<<0xCE, i::32, r::binary>>, _h, _d), do: {i, r}
  defp dec(<<0xCF, i::64, r::binary>>, _h, _d), do: {i, r}
  defp dec(<<0xD0, i::signed-8, r::binary>>, _h, _d), do: {i, r}
  defp dec(<<0xD1, i::signed-16, r::binary>>, _h, _d), do: {i, r}
  defp dec(<<0xD2, i::signed-32, r::binary>>, _h, _d), do: {i, r}
  defp dec(<<0xD3, i::signed-64, r::binary>>, _h, _d), do: {i, r}
  defp dec(<<0xCB, f::float-64, r::binary>>, _h, _d), do: {f, r}
  defp dec(<<0xCB, b::binary-8, r::binary>>, _h, _d), do: {special_float(b), r}
  defp dec(<<0xCA, f::float-32, r::binary>>, _h, _d), do: {f, r}
  defp dec(<<0xCA, b::binary-4, r::binary>>, _h, _d), do: {special_float(b), r}
  defp dec(<<0xD9, n::8, s::binary-size(n), r::binary>>, _h, _d), do: {s, r}
  defp dec(<<0xDA, n::16, s::binary-size(n), r::binary>>, _h, _d), do: {s, r}
  defp dec(<<0xDB, n::32, s::binary-size(n), r::binary>>, _h, _d), do: {s, r}
  defp dec(<<0xC4, n::8, s::binary-size(n), r::binary>>, _h, _d), do: {s, r}
  defp dec(<<0xC5, n::16, s::binary-size(n), r::binary>>, _h, _d), do: {s, r}
  defp dec(<<0xC6, n::32, s::binary-size(n), r::binary>>, _h, _d), do: {s, r}
  defp dec(<<0xDC, n::16, r::binary>>, h, d), do: dec_list(r, n, [], h, d - 1)
  defp dec(<<0xDD, n::32, r::binary>>, h, d), do: dec_list(r, n, [], h, d - 1)
  defp dec(<<0xDE, n::16, r::binary>>, h, d), do: dec_map(r, n, n, [], h, d - 1)
  defp dec(<<0xDF, n::32, r::binary>>, h, d), do: dec_map(r, n, n, [], h, d - 1)
  defp dec(<<0xD4, t::signed-8, x::binary-1, r::binary>>, h, d), do: {ext(t, x, h, d), r}
  defp dec(<<0xD5, t::signed-8, x::binary-2, r::binary>>, h, d), do: {ext(t, x, h, d), r}
  defp dec(<<0xD6, t::signed-8, x::binary-4, r::binary>>, h, d), do: {ext(t, x, h, d), r}
  defp dec(<<0xD7, t::signed-8, x::binary-8, r::binary>>, h, d), do: {ext(t, x, h, d), r}
  defp dec(<<0xD8, t::signed-8, x::binary-16, r::binary>>, h, d), do: {ext(t, x, h, d), r}

  defp dec(<<0xC7, n::8, t::signed-8, x::binary-size(n), r::binary>>, h, d),
    do: {ext(t, x, h, d), r}

  defp dec(<<0xC8, n::16, t::signed-8, x::binary-size(n), r::binary>>, h, d),
    do: {ext(t, x, h, d), r}

  defp dec(<<0xC9, n::32, t::signed-8, x::binary-size(n), r::binary>>, h, d),
    do: {ext(t, x, h, d), r}

  defp dec(<<0xC1, _::binary>>, _h, _d), do: fail!("reserved type byte 0xC1")
  defp dec(<<>>, _h, _d), do: fail!("input ended where a value was expected")
  defp dec(<<b, r::binary>>, _h, _d), do: fail!(truncated(b, r))

  defp neg_fixint(<<i::signed-8, _::binary>>), do: i

  defp ext(t, x, h, d), do: h.decode_ext(t, x, d - 1)

  defp dec_list(r, 0, acc, _h, _d), do: {:lists.reverse(acc), r}

  defp dec_list(r, n, acc, h, d) do
    {v, r} = dec(r, h, d)
    dec_list(r, n - 1, [v | acc], h, d)
  end

  defp dec_map(r, 0, n, acc, _h, _d) do
    map = :maps.from_list(acc)
    if map_size(map) != n, do: fail!(repeated_key(acc, n))
    {map, r}
  end

  defp dec_map(r, left, n, acc, h, d) do
    {k, r} = dec(r, h, d)
    {v, r} = dec(r, h, d)
    dec_map(r, left - 1, n, [{k, v} | acc], h, d)
  end

  # Only on the error path: which key came twice (Python's str and bytes of the same
  # bytes are two keys there, and one binary here).
  defp repeated_key(pairs, n) do
    {key, _} =
      Enum.reduce_while(pairs, {nil, MapSet.new()}, fn {k, _}, {_, seen} ->
        if MapSet.member?(seen, k),
          do: {:halt, {k, seen}},
          else: {:cont, {nil, MapSet.put(seen, k)}}
      end)

    "a map of #{n} pairs repeats the key #{inspect(key, limit: 5)} once decoded " <>
      "(Python's str and bytes of the same bytes both decode to one binary)"
  end

  # NaN and the infinities have no Erlang float: they decode to atoms.
  defp special_float(<<_::1, 0xFF::8, 0::23>> = b), do: infinity(b)
  defp special_float(<<_::1, 0xFF::8, _::23>>), do: :nan
  defp special_float(<<_::1, 0x7FF::11, 0::52>> = b), do: infinity(b)
  defp special_float(<<_::1, 0x7FF::11, _::52>>), do: :nan

  defp infinity(<<0::1, _::bitstring>>), do: :infinity
  defp infinity(<<1::1, _::bitstring>>), do: :neg_infinity

  defp truncated(type_byte, rest) do
    "truncated input: #{byte_size(rest)} bytes left after type byte " <>
      "0x#{Integer.to_string(type_byte, 16)}#{declared(type_byte, rest)}"
  end

  # The length a header declared, for the error message.
  defp declared(b, <<n::8, _::binary>>) when b in [0xD9, 0xC4, 0xC7], do: ", which declares #{n}"

  defp declared(b, <<n::16, _::binary>>) when b in [0xDA, 0xC5, 0xC8, 0xDC, 0xDE],
    do: ", which declares #{n}"

  defp declared(b, <<n::32, _::binary>>) when b in [0xDB, 0xC6, 0xC9, 0xDD, 0xDF],
    do: ", which declares #{n}"

  defp declared(b, _) when b >= 0xA0 and b <= 0xBF, do: ", which declares #{b &&& 0x1F}"
  defp declared(_b, _), do: ""
end
