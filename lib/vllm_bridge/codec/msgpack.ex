defmodule VllmBridge.Codec.Msgpack do
  @moduledoc """
  The msgpack engine (https://github.com/msgpack/msgpack/blob/master/spec.md) under
  `VllmBridge.Codec`.

  Plain msgpack: `nil`, booleans, integers of the 64-bit range, floats (always float 64),
  binaries (str when valid UTF-8, else bin), lists (array) and maps (map, keys in Erlang
  term order, so equal maps always give equal bytes). Every other term is handed to a
  *handler* module (this behaviour), which is how `VllmBridge.Codec` adds the extension
  types of docs/PROTOCOL.md. Used on its own (`encode/1`, `decode/1`), the handler is this
  module: extension values travel as `{:msgpack_ext, type, payload}` and any other term is
  refused.

  Encoding refuses a term nested deeper than a depth budget (`max_depth/0` levels by
  default: each list, map, and each extension value that nests others, counts one) with
  an `ArgumentError`, and hands the keys of every map whose keys are not all binaries to
  the handler's `check_keys/1`, which may refuse them (`VllmBridge.Codec.Ext` refuses keys
  Python cannot hash or would merge).

  Decoding never raises and never allocates from a declared length: every length is
  checked against the bytes actually present (binaries come out as sub-binaries of the
  input, no copy), nesting is limited to 1024 levels, and malformed input is
  `{:error, reason}`.
  """

  import Bitwise

  @typedoc "An msgpack extension value as the plain codec sees it: type code and payload."
  @type ext :: {:msgpack_ext, integer(), binary()}

  # Decoding: how deeply values may nest (replies from a worker).
  @max_depth 1024
  # Encoding: the protocol's limit for one value (docs/PROTOCOL.md, "Values").
  @max_encode_depth 64

  @doc """
  Encodes a term that plain msgpack cannot hold; `handler` is the handler module to pass
  on when encoding nested values and `depth` the levels the term may still use: a term
  that nests others (a tuple, a struct) spends one (`nest!/2`) and encodes them with
  `encode_nested/3` and one level less. Raises `ArgumentError` naming the term when it
  has no encoding.
  """
  @callback encode_other(term(), handler :: module(), depth :: non_neg_integer()) :: iodata()

  @doc """
  Checks the keys of a map about to be encoded (`pairs` in key order) whose keys are not
  all binaries; raises `ArgumentError` naming the keys it refuses.
  """
  @callback check_keys(pairs :: [{term(), term()}]) :: :ok

  @doc """
  Decodes the payload of extension `type`; `depth` is the nesting budget left for
  `decode_exact/3`. Reports malformed payloads with `fail!/1`.
  """
  @callback decode_ext(type :: integer(), payload :: binary(), depth :: non_neg_integer()) ::
              term()

  @doc "Encodes `term` with plain msgpack; raises `ArgumentError` naming a value it cannot encode."
  @spec encode(term()) :: iodata()
  def encode(term), do: encode(term, __MODULE__, @max_encode_depth)

  @doc """
  Encodes `term`, handing every non-plain value to `handler` (see the callbacks), nested
  at most `depth` levels (default `max_depth/0`).
  """
  @spec encode(term(), module(), non_neg_integer()) :: iodata()
  def encode(term, handler, depth \\ @max_encode_depth) do
    enc(term, handler, depth)
  catch
    :throw, {__MODULE__, :too_deep, inner} ->
      raise ArgumentError,
            "cannot encode a value nested deeper than #{depth} levels (lists, maps, tuples " <>
              "and structs each count one): #{inspect(inner, limit: 3)} sits below that"
  end

  @doc "The levels a value may nest when encoded (docs/PROTOCOL.md, \"Values\")."
  @spec max_depth() :: pos_integer()
  def max_depth, do: @max_encode_depth

  @doc false
  # Encodes a value nested inside another (for handlers): `depth` levels left.
  @spec encode_nested(term(), module(), non_neg_integer()) :: iodata()
  def encode_nested(term, handler, depth), do: enc(term, handler, depth)

  @doc false
  # Spends one level for `term`, which nests others; aborts the encode when none is left.
  @spec nest!(term(), non_neg_integer()) :: pos_integer()
  def nest!(term, 0), do: throw({__MODULE__, :too_deep, term})
  def nest!(_term, depth), do: depth

  @doc "Decodes one plain msgpack value that must span the whole binary."
  @spec decode(binary()) :: {:ok, term()} | {:error, String.t()}
  def decode(bin), do: decode(bin, __MODULE__)

  @doc "Decodes one value spanning the whole binary, extension payloads going to `handler`."
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

  # -- helpers for handlers --------------------------------------------------

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

  @doc false
  @spec enc_str(binary()) :: iodata()
  def enc_str(s) do
    case byte_size(s) do
      n when n < 32 -> [0xA0 + n | s]
      n when n < 0x100 -> [<<0xD9, n>> | s]
      n when n < 0x10000 -> [<<0xDA, n::16>> | s]
      n when n < 0x100000000 -> [<<0xDB, n::32>> | s]
      n -> raise ArgumentError, "a string of #{n} bytes is over the msgpack limit of 4 GiB"
    end
  end

  @doc false
  @spec enc_bin(binary()) :: iodata()
  def enc_bin(b) do
    case byte_size(b) do
      n when n < 0x100 -> [<<0xC4, n>> | b]
      n when n < 0x10000 -> [<<0xC5, n::16>> | b]
      n when n < 0x100000000 -> [<<0xC6, n::32>> | b]
      n -> raise ArgumentError, "a binary of #{n} bytes is over the msgpack limit of 4 GiB"
    end
  end

  @doc false
  # An extension value: header and payload (its length computed here).
  @spec enc_ext(integer(), iodata()) :: iodata()
  def enc_ext(type, payload), do: [ext_header(type, IO.iodata_length(payload)) | payload]

  @doc false
  # The header of an extension value whose payload is `n` bytes long.
  @spec ext_header(integer(), non_neg_integer()) :: binary()
  def ext_header(type, 1), do: <<0xD4, type::signed-8>>
  def ext_header(type, 2), do: <<0xD5, type::signed-8>>
  def ext_header(type, 4), do: <<0xD6, type::signed-8>>
  def ext_header(type, 8), do: <<0xD7, type::signed-8>>
  def ext_header(type, 16), do: <<0xD8, type::signed-8>>
  def ext_header(type, n) when n < 0x100, do: <<0xC7, n, type::signed-8>>
  def ext_header(type, n) when n < 0x10000, do: <<0xC8, n::16, type::signed-8>>
  def ext_header(type, n) when n < 0x100000000, do: <<0xC9, n::32, type::signed-8>>

  def ext_header(type, n),
    do: raise(ArgumentError, "extension #{type} payload of #{n} bytes is over the 4 GiB limit")

  # -- plain handler -------------------------------------------------------------
  # (This module is the handler of plain msgpack; a module cannot declare its own
  # behaviour, so the callbacks are implemented without @impl.)

  @doc false
  @spec encode_other(term(), module(), non_neg_integer()) :: iodata()
  def encode_other({:msgpack_ext, type, data}, _handler, _depth)
      when is_integer(type) and type >= -128 and type <= 127 and is_binary(data),
      do: enc_ext(type, data)

  def encode_other(other, _handler, _depth),
    do: raise(ArgumentError, "cannot encode #{inspect(other, limit: 5)} as plain msgpack")

  @doc false
  @spec check_keys([{term(), term()}]) :: :ok
  def check_keys(_pairs), do: :ok

  @doc false
  @spec decode_ext(integer(), binary(), non_neg_integer()) :: ext()
  def decode_ext(type, data, _depth), do: {:msgpack_ext, type, data}

  # -- encoding --------------------------------------------------------------

  defp enc(nil, _h, _d), do: <<0xC0>>
  defp enc(false, _h, _d), do: <<0xC2>>
  defp enc(true, _h, _d), do: <<0xC3>>
  defp enc(i, _h, _d) when is_integer(i) and i >= 0 and i < 128, do: <<i>>
  defp enc(i, _h, _d) when is_integer(i) and i < 0 and i >= -32, do: <<i::signed-8>>
  defp enc(i, _h, _d) when is_integer(i) and i >= 0 and i < 0x100, do: <<0xCC, i>>
  defp enc(i, _h, _d) when is_integer(i) and i >= 0 and i < 0x10000, do: <<0xCD, i::16>>
  defp enc(i, _h, _d) when is_integer(i) and i >= 0 and i < 0x100000000, do: <<0xCE, i::32>>

  defp enc(i, _h, _d) when is_integer(i) and i >= 0 and i < 0x10000000000000000,
    do: <<0xCF, i::64>>

  defp enc(i, _h, _d) when is_integer(i) and i < 0 and i >= -0x80, do: <<0xD0, i::signed-8>>
  defp enc(i, _h, _d) when is_integer(i) and i < 0 and i >= -0x8000, do: <<0xD1, i::signed-16>>

  defp enc(i, _h, _d) when is_integer(i) and i < 0 and i >= -0x80000000,
    do: <<0xD2, i::signed-32>>

  defp enc(i, _h, _d) when is_integer(i) and i < 0 and i >= -0x8000000000000000,
    do: <<0xD3, i::signed-64>>

  defp enc(f, _h, _d) when is_float(f), do: <<0xCB, f::float-64>>

  defp enc(s, _h, _d) when is_binary(s) do
    # :unicode.characters_to_binary/1 returns its (valid UTF-8) argument itself, uncopied;
    # it is several times faster than String.valid?/1.
    if is_binary(:unicode.characters_to_binary(s)), do: enc_str(s), else: enc_bin(s)
  end

  defp enc(l, _h, 0) when is_list(l), do: throw({__MODULE__, :too_deep, l})
  defp enc(l, h, d) when is_list(l), do: [list_header(l) | enc_list(l, h, d - 1)]
  defp enc(m, _h, 0) when is_map(m) and not is_struct(m), do: throw({__MODULE__, :too_deep, m})

  defp enc(m, h, d) when is_map(m) and not is_struct(m) do
    n = map_size(m)
    pairs = :lists.keysort(1, :maps.to_list(m))

    # Binaries sort last: a map whose first key is one has only binary keys, which the
    # handler never needs to see (the common case: string-keyed maps, kwargs).
    case pairs do
      [] -> :ok
      [{k, _} | _] when is_binary(k) -> :ok
      _ -> h.check_keys(pairs)
    end

    header =
      cond do
        n < 16 -> 0x80 + n
        n < 0x10000 -> <<0xDE, n::16>>
        true -> <<0xDF, n::32>>
      end

    [header | enc_pairs(pairs, h, d - 1)]
  end

  defp enc(other, h, d), do: h.encode_other(other, h, d)

  defp list_header(l) do
    n =
      try do
        length(l)
      rescue
        ArgumentError ->
          reraise ArgumentError,
                  "cannot encode the improper list #{inspect(l, limit: 5)}",
                  __STACKTRACE__
      end

    cond do
      n < 16 -> 0x90 + n
      n < 0x10000 -> <<0xDC, n::16>>
      true -> <<0xDD, n::32>>
    end
  end

  defp enc_list([], _h, _d), do: []
  defp enc_list([x | rest], h, d), do: [enc(x, h, d) | enc_list(rest, h, d)]

  defp enc_pairs([], _h, _d), do: []

  defp enc_pairs([{k, v} | rest], h, d),
    do: [enc(k, h, d), enc(v, h, d) | enc_pairs(rest, h, d)]

  # -- decoding --------------------------------------------------------------

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
