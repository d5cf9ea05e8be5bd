defmodule VllmBridge.Codec.Msgpack do
  @moduledoc false
  # The msgpack engine (https://github.com/msgpack/msgpack/blob/master/spec.md) under
  # `VllmBridge.Codec`.
  #
  # Plain msgpack: `nil`, booleans, integers of the 64-bit range, floats (always float 64),
  # binaries (str when valid UTF-8, else bin), lists (array) and maps (map, keys in Erlang
  # term order, so equal maps always give equal bytes). Every other term is handed to a
  # *handler* module (this behaviour), which is how `VllmBridge.Codec` adds the extension
  # types of docs/PROTOCOL.md. Used on its own (`encode/1`, `decode/1`), the handler is this
  # module: extension values travel as `{:msgpack_ext, type, payload}` and any other term is
  # refused.
  #
  # Encoding refuses a term nested deeper than a depth budget (`max_depth/0` levels by
  # default: each list, map, and each extension value that nests others, counts one) with
  # an `ArgumentError`, and hands the keys of every map whose keys are not all binaries to
  # the handler's `check_keys/1`, which may refuse them (`VllmBridge.Codec.Ext` refuses keys
  # Python cannot hash or would merge).
  #
  # Decoding never raises and never allocates from a declared length: every length is
  # checked against the bytes actually present (binaries come out as sub-binaries of the
  # input, no copy), nesting is limited to 1024 levels, and malformed input is
  # `{:error, reason}`.

  alias VllmBridge.Codec.Msgpack.Decoder

  @typedoc "An msgpack extension value as the plain codec sees it: type code and payload."
  @type ext :: {:msgpack_ext, integer(), binary()}

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
  `VllmBridge.Codec.Msgpack.Decoder.decode_exact/3`. Reports malformed payloads with
  `VllmBridge.Codec.Msgpack.Decoder.fail!/1`.
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
  defdelegate decode(bin, handler), to: Decoder

  # -- helpers for handlers --------------------------------------------------

  @doc false
  # The header of an array of `n` elements: for fewer than 16, its one byte as an integer
  # (the cheapest iodata). The one array header encoder of the codec and the wire.
  @spec enc_array_header(non_neg_integer()) :: byte() | binary()
  def enc_array_header(n) when n < 16, do: 0x90 + n
  def enc_array_header(n) when n < 0x10000, do: <<0xDC, n::16>>
  def enc_array_header(n) when n < 0x100000000, do: <<0xDD, n::32>>

  def enc_array_header(n),
    do: raise(ArgumentError, "an array of #{n} elements is over the msgpack limit of 2^32 - 1")

  @doc false
  # The header of a map of `n` pairs, as `enc_array_header/1` is of an array.
  @spec enc_map_header(non_neg_integer()) :: byte() | binary()
  def enc_map_header(n) when n < 16, do: 0x80 + n
  def enc_map_header(n) when n < 0x10000, do: <<0xDE, n::16>>
  def enc_map_header(n) when n < 0x100000000, do: <<0xDF, n::32>>

  def enc_map_header(n),
    do: raise(ArgumentError, "a map of #{n} pairs is over the msgpack limit of 2^32 - 1")

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

    [enc_map_header(n) | enc_pairs(pairs, h, d - 1)]
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

    enc_array_header(n)
  end

  defp enc_list([], _h, _d), do: []
  defp enc_list([x | rest], h, d), do: [enc(x, h, d) | enc_list(rest, h, d)]

  defp enc_pairs([], _h, _d), do: []

  defp enc_pairs([{k, v} | rest], h, d),
    do: [enc(k, h, d), enc(v, h, d) | enc_pairs(rest, h, d)]
end
