defmodule VllmBridge.Codec do
  @moduledoc """
  The bridge's value codec: msgpack plus the extension types of docs/PROTOCOL.md
  ("Values and extension types"), written by the bridge's own msgpack engine.

  | Elixir | wire | decodes back to |
  |---|---|---|
  | `nil`, `true`, `false` | nil, bool | the same |
  | integer in -2^63..2^64-1 | int | the same |
  | integer outside it, up to 4 096 magnitude bytes (32 768 bits) | ext 7 (big integer) | the same |
  | float | float 64 | the same (`-0.0` keeps its sign bit) |
  | `:nan`, `:infinity`, `:neg_infinity` | float 64 NaN / +inf / -inf | the same atom |
  | binary, valid UTF-8 | str | the binary |
  | binary, not UTF-8; `%VllmBridge.Bytes{}` | bin | a binary |
  | list | array | a list |
  | map (not a struct) | map, pairs in key term order | a map |
  | other atom | ext 1 | the atom when it exists, else its name as a string |
  | tuple | ext 2 | the tuple |
  | `%VllmBridge.Tensor{}` | ext 3 | the tensor (data zero-copy) |
  | struct with `__python_class__/0` | ext 4 | the struct when its class is registered |
  | `%VllmBridge.Object{}` | ext 4 | the object (same bytes again) |
  | - | ext 5 (enum member) | the lower-cased member name as an existing atom, else as a string |
  | `%VllmBridge.Ref{}` | ext 6 | the reference |

  Map keys go through the same table, so atom keys travel as ext 1 (Python sees a `str`
  subclass). Pairs are written in Erlang term order of the keys (for atoms, alphabetical),
  whatever the map's size, so equal maps always give equal bytes.

  Enum members are decode-only: Elixir has no enum values; an atom sent where Python
  expects an enum is converted by the worker by member name.

  **Refused, never changed.** Encoding raises an `ArgumentError` naming the value when
  Python could not take it as it is: a map key Python cannot hash (a list, a map, a tuple
  holding one), two map keys Python holds equal (`1` and `true`, `1` and `1.0`, `:a` and
  `"a"`, a struct and a `VllmBridge.Object` of its class with equal fields: a dict would
  keep one), an Object whose field names are not all strings, an integer of more than
  4 096 magnitude bytes, or a value nested deeper than `max_depth/0` levels (docs/PROTOCOL.md, "Map keys, nesting, keyword arguments").
  Whether a dataclass is frozen is not known here: a struct key of one that is not (it
  cannot be hashed) is refused by the worker, under the request's id, not before sending.

      iex> VllmBridge.Codec.encode(%{1 => "a", true => "b"})
      ** (ArgumentError) the map keys 1 and true are equal in Python (true == 1 and false == 0), so a dict would keep only one of them: give each its own key

  Decoding never raises: malformed input (truncated, bad extension payloads, unknown
  extension codes, bad tensor headers, declared lengths beyond the input, nesting deeper
  than 1024, a big integer of more than 4 096 magnitude bytes) is `{:error, reason}`. Nothing decoded creates an atom or loads a module.
  Binaries in a decoded value are sub-binaries of the input (no copy): they keep the input
  alive while they live; `:binary.copy/1` one to keep it apart.
  """

  alias VllmBridge.Codec.{Ext, Msgpack}

  @doc """
  Encodes a term to iodata; raises `ArgumentError` naming a value it cannot encode or
  that Python could not take as it is (see above).

      iex> VllmBridge.Codec.encode([1, :ok, "two"]) |> IO.iodata_to_binary()
      <<0x93, 1, 0xD5, 1, "ok", 0xA3, "two">>
      iex> VllmBridge.Codec.encode([1, :ok, "two"]) |> IO.iodata_to_binary() |> VllmBridge.Codec.decode()
      {:ok, [1, :ok, "two"]}
  """
  @spec encode(term()) :: iodata()
  def encode(term), do: Msgpack.encode(term, Ext)

  @doc "How many levels a value may nest (each list, map, tuple, struct and reference counts one)."
  @spec max_depth() :: pos_integer()
  def max_depth, do: Msgpack.max_depth()

  @doc "Decodes one whole body; malformed input is `{:error, reason}`, never a raise."
  @spec decode(binary()) :: {:ok, term()} | {:error, String.t()}
  def decode(bin), do: Msgpack.decode(bin, Ext)
end
