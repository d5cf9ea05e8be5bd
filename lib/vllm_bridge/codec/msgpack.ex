defmodule VllmBridge.Codec.Msgpack do
  @moduledoc """
  A small msgpack codec (https://github.com/msgpack/msgpack/blob/master/spec.md).

  Elixir to msgpack: `nil`, booleans, integers (64-bit range), floats (always float 64),
  binaries (str when valid UTF-8, else bin), lists (array) and maps (map).
  Extension types are handled by `VllmBridge.Codec`, which wraps this module.

  Decoding never raises on malformed input: `decode/1` returns `{:error, reason}`.
  """

  @typedoc "An msgpack extension value as this layer sees it: type code and payload."
  @type ext :: {:msgpack_ext, integer(), binary()}

  @doc """
  Encodes `term` to iodata. Raises `ArgumentError` naming the value it cannot encode.
  """
  @spec encode(term()) :: iodata()
  def encode(term), do: enc(term)

  @doc """
  Decodes one msgpack value that must span the whole binary.
  """
  @spec decode(binary()) :: {:ok, term()} | {:error, String.t()}
  def decode(bin) when is_binary(bin) do
    case dec(bin) do
      {value, <<>>} -> {:ok, value}
      {_value, rest} -> {:error, "#{byte_size(rest)} trailing bytes after the value"}
    end
  rescue
    e in [MatchError, FunctionClauseError, CaseClauseError, ArgumentError] ->
      {:error, "malformed msgpack: " <> Exception.message(e)}
  end

  # -- encoding --------------------------------------------------------------

  defp enc(nil), do: <<0xC0>>
  defp enc(false), do: <<0xC2>>
  defp enc(true), do: <<0xC3>>
  defp enc({:msgpack_ext, type, data}) when is_integer(type), do: enc_ext(type, data)

  defp enc(i) when is_integer(i) and i >= 0 and i < 128, do: <<i>>
  defp enc(i) when is_integer(i) and i < 0 and i >= -32, do: <<i::signed-8>>
  defp enc(i) when is_integer(i) and i >= 0 and i < 0x100, do: <<0xCC, i>>
  defp enc(i) when is_integer(i) and i >= 0 and i < 0x10000, do: <<0xCD, i::16>>
  defp enc(i) when is_integer(i) and i >= 0 and i < 0x100000000, do: <<0xCE, i::32>>

  defp enc(i) when is_integer(i) and i >= 0 and i < 0x10000000000000000,
    do: <<0xCF, i::64>>

  defp enc(i) when is_integer(i) and i >= -0x80, do: <<0xD0, i::signed-8>>
  defp enc(i) when is_integer(i) and i >= -0x8000, do: <<0xD1, i::signed-16>>
  defp enc(i) when is_integer(i) and i >= -0x80000000, do: <<0xD2, i::signed-32>>

  defp enc(i) when is_integer(i) and i >= -0x8000000000000000,
    do: <<0xD3, i::signed-64>>

  defp enc(i) when is_integer(i),
    do: raise(ArgumentError, "integer #{i} is outside the 64-bit range of msgpack")

  defp enc(f) when is_float(f), do: <<0xCB, f::float-64>>

  defp enc(s) when is_binary(s) do
    if String.valid?(s), do: enc_str(s), else: enc_bin(s)
  end

  defp enc(l) when is_list(l) do
    n = length(l)

    header =
      cond do
        n < 16 -> <<0x90 + n>>
        n < 0x10000 -> <<0xDC, n::16>>
        true -> <<0xDD, n::32>>
      end

    [header | Enum.map(l, &enc/1)]
  end

  defp enc(m) when is_map(m) and not is_struct(m) do
    n = map_size(m)

    header =
      cond do
        n < 16 -> <<0x80 + n>>
        n < 0x10000 -> <<0xDE, n::16>>
        true -> <<0xDF, n::32>>
      end

    [header | Enum.map(m, fn {k, v} -> [enc(k), enc(v)] end)]
  end

  defp enc(other),
    do: raise(ArgumentError, "cannot encode #{inspect(other, limit: 5)} as msgpack")

  @doc false
  @spec enc_str(binary()) :: iodata()
  def enc_str(s) do
    n = byte_size(s)

    cond do
      n < 32 -> [<<0xA0 + n>>, s]
      n < 0x100 -> [<<0xD9, n>>, s]
      n < 0x10000 -> [<<0xDA, n::16>>, s]
      true -> [<<0xDB, n::32>>, s]
    end
  end

  @doc false
  @spec enc_bin(binary()) :: iodata()
  def enc_bin(b) do
    n = byte_size(b)

    cond do
      n < 0x100 -> [<<0xC4, n>>, b]
      n < 0x10000 -> [<<0xC5, n::16>>, b]
      true -> [<<0xC6, n::32>>, b]
    end
  end

  @doc false
  @spec enc_ext(integer(), iodata()) :: iodata()
  def enc_ext(type, data) do
    n = IO.iodata_length(data)

    header =
      case n do
        1 -> <<0xD4, type::signed-8>>
        2 -> <<0xD5, type::signed-8>>
        4 -> <<0xD6, type::signed-8>>
        8 -> <<0xD7, type::signed-8>>
        16 -> <<0xD8, type::signed-8>>
        n when n < 0x100 -> <<0xC7, n, type::signed-8>>
        n when n < 0x10000 -> <<0xC8, n::16, type::signed-8>>
        n -> <<0xC9, n::32, type::signed-8>>
      end

    [header, data]
  end

  # -- decoding --------------------------------------------------------------

  defp dec(<<0xC0, r::binary>>), do: {nil, r}
  defp dec(<<0xC2, r::binary>>), do: {false, r}
  defp dec(<<0xC3, r::binary>>), do: {true, r}
  defp dec(<<0::1, i::7, r::binary>>), do: {i, r}
  defp dec(<<0b111::3, i::signed-5, r::binary>>), do: {i, r}
  defp dec(<<0xCC, i::8, r::binary>>), do: {i, r}
  defp dec(<<0xCD, i::16, r::binary>>), do: {i, r}
  defp dec(<<0xCE, i::32, r::binary>>), do: {i, r}
  defp dec(<<0xCF, i::64, r::binary>>), do: {i, r}
  defp dec(<<0xD0, i::signed-8, r::binary>>), do: {i, r}
  defp dec(<<0xD1, i::signed-16, r::binary>>), do: {i, r}
  defp dec(<<0xD2, i::signed-32, r::binary>>), do: {i, r}
  defp dec(<<0xD3, i::signed-64, r::binary>>), do: {i, r}
  defp dec(<<0xCA, f::binary-4, r::binary>>), do: {dec_float(f), r}
  defp dec(<<0xCB, f::binary-8, r::binary>>), do: {dec_float(f), r}
  defp dec(<<0b101::3, n::5, s::binary-size(n), r::binary>>), do: {s, r}
  defp dec(<<0xD9, n::8, s::binary-size(n), r::binary>>), do: {s, r}
  defp dec(<<0xDA, n::16, s::binary-size(n), r::binary>>), do: {s, r}
  defp dec(<<0xDB, n::32, s::binary-size(n), r::binary>>), do: {s, r}
  defp dec(<<0xC4, n::8, s::binary-size(n), r::binary>>), do: {s, r}
  defp dec(<<0xC5, n::16, s::binary-size(n), r::binary>>), do: {s, r}
  defp dec(<<0xC6, n::32, s::binary-size(n), r::binary>>), do: {s, r}
  defp dec(<<0b1001::4, n::4, r::binary>>), do: dec_list(r, n, [])
  defp dec(<<0xDC, n::16, r::binary>>), do: dec_list(r, n, [])
  defp dec(<<0xDD, n::32, r::binary>>), do: dec_list(r, n, [])
  defp dec(<<0b1000::4, n::4, r::binary>>), do: dec_map(r, n, [])
  defp dec(<<0xDE, n::16, r::binary>>), do: dec_map(r, n, [])
  defp dec(<<0xDF, n::32, r::binary>>), do: dec_map(r, n, [])
  defp dec(<<0xD4, t::signed-8, d::binary-1, r::binary>>), do: {{:msgpack_ext, t, d}, r}
  defp dec(<<0xD5, t::signed-8, d::binary-2, r::binary>>), do: {{:msgpack_ext, t, d}, r}
  defp dec(<<0xD6, t::signed-8, d::binary-4, r::binary>>), do: {{:msgpack_ext, t, d}, r}
  defp dec(<<0xD7, t::signed-8, d::binary-8, r::binary>>), do: {{:msgpack_ext, t, d}, r}
  defp dec(<<0xD8, t::signed-8, d::binary-16, r::binary>>), do: {{:msgpack_ext, t, d}, r}

  defp dec(<<0xC7, n::8, t::signed-8, d::binary-size(n), r::binary>>),
    do: {{:msgpack_ext, t, d}, r}

  defp dec(<<0xC8, n::16, t::signed-8, d::binary-size(n), r::binary>>),
    do: {{:msgpack_ext, t, d}, r}

  defp dec(<<0xC9, n::32, t::signed-8, d::binary-size(n), r::binary>>),
    do: {{:msgpack_ext, t, d}, r}

  defp dec(<<0xC1, _::binary>>), do: raise(ArgumentError, "reserved byte 0xC1")
  defp dec(<<>>), do: raise(ArgumentError, "input ended before a value")

  defp dec(<<b, _::binary>>),
    do: raise(ArgumentError, "truncated value after type byte 0x#{Integer.to_string(b, 16)}")

  defp dec_list(r, 0, acc), do: {:lists.reverse(acc), r}

  defp dec_list(r, n, acc) do
    {v, r} = dec(r)
    dec_list(r, n - 1, [v | acc])
  end

  defp dec_map(r, 0, acc), do: {:maps.from_list(acc), r}

  defp dec_map(r, n, acc) do
    {k, r} = dec(r)
    {v, r} = dec(r)
    dec_map(r, n - 1, [{k, v} | acc])
  end

  # NaN and the infinities have no Elixir float: they decode to atoms.
  defp dec_float(<<f::float-32>>), do: f
  defp dec_float(<<f::float-64>>), do: f
  defp dec_float(<<_::1, 0xFF::8, 0::23>> = b), do: inf(b)
  defp dec_float(<<_::1, 0xFF::8, _::23>>), do: :nan
  defp dec_float(<<_::1, 0x7FF::11, 0::52>> = b), do: inf(b)
  defp dec_float(<<_::1, 0x7FF::11, _::52>>), do: :nan

  defp inf(<<0::1, _::bitstring>>), do: :infinity
  defp inf(<<1::1, _::bitstring>>), do: :neg_infinity
end
