defmodule VllmBridge.Codec.Ext do
  @moduledoc false
  # The extension types of docs/PROTOCOL.md, as the `VllmBridge.Codec.Msgpack` handler that
  # `VllmBridge.Codec` uses: atoms (1), tuples (2), tensors (3, `VllmBridge.Codec.TensorExt`),
  # dataclasses (4, `VllmBridge.Codec.Dataclass`), enum members (5, decode only), object
  # references (6), big integers (7), tensors in slots (8, `VllmBridge.Codec.SlotExt`), plus the special floats and `VllmBridge.Bytes`.
  #
  # Map keys are checked against Python's dict (`check_keys/1`, `VllmBridge.Codec.PyKeys`):
  # a key Python cannot hash, or two keys that are equal there (`1` and `true`, `1` and
  # `1.0`, `:a` and `"a"`), is refused with an `ArgumentError` naming them, since Python
  # would refuse the first and silently keep one of the others.

  @behaviour VllmBridge.Codec.Msgpack

  alias VllmBridge.Codec.{Dataclass, Msgpack, PyKeys, SlotExt, TensorExt}
  alias VllmBridge.Codec.Msgpack.Decoder
  alias VllmBridge.{Bytes, Object, Ref, Tensor}

  @atom 1
  @tuple 2
  @tensor 3
  @dataclass 4
  @enum 5
  @ref 6
  @bigint 7
  @slot_tensor 8

  # The most magnitude bytes of a big integer (ext 7), both ways: 32 768 bits, more than
  # twice the 4 300 decimal digits Python prints by default. Printing an integer takes
  # time quadratic in its size (a 200 KB one, seconds; logs and errors print values),
  # and a frame from a worker is untrusted, so a larger one is refused, never decoded.
  @bigint_max_bytes 4096

  # -- encoding --------------------------------------------------------------

  # A tuple's payload is its array, at the tuple's own level; a struct and a reference
  # spend one level for their payload (each is one nested extension value in Python).
  @impl true
  def encode_other(:nan, _h, _d), do: <<0xCB, 0x7FF8000000000000::64>>
  def encode_other(:infinity, _h, _d), do: <<0xCB, 0x7FF0000000000000::64>>
  def encode_other(:neg_infinity, _h, _d), do: <<0xCB, 0xFFF0000000000000::64>>

  def encode_other(atom, _h, _d) when is_atom(atom) do
    name = Atom.to_string(atom)
    [Msgpack.ext_header(@atom, byte_size(name)) | name]
  end

  def encode_other(tuple, h, d) when is_tuple(tuple),
    do: Msgpack.enc_ext(@tuple, Msgpack.encode_nested(Tuple.to_list(tuple), h, d))

  def encode_other(%Tensor{} = t, _h, _d), do: TensorExt.encode(t)
  def encode_other(%Bytes{data: data}, _h, _d) when is_binary(data), do: Msgpack.enc_bin(data)

  def encode_other(%Ref{instance: i, id: id, session: s, type: type} = ref, _h, d)
      when is_binary(i) and is_integer(id) and (is_binary(s) or is_nil(s)) and is_binary(type) do
    Msgpack.nest!(ref, d)
    Msgpack.enc_ext(@ref, Msgpack.encode([i, id, s, type]))
  end

  def encode_other(%Object{} = o, h, d),
    do: Msgpack.enc_ext(@dataclass, Dataclass.encode_object(o, h, Msgpack.nest!(o, d) - 1))

  def encode_other(%module{} = bad, _h, _d) when module in [Bytes, Ref] do
    raise ArgumentError, "cannot encode #{inspect(bad, limit: 5)}: a field has the wrong type"
  end

  def encode_other(%_{} = struct, h, d),
    do:
      Msgpack.enc_ext(
        @dataclass,
        Dataclass.encode_struct(struct, h, Msgpack.nest!(struct, d) - 1)
      )

  def encode_other(i, _h, _d) when is_integer(i) do
    {sign, magnitude} = if i < 0, do: {1, -i}, else: {0, i}
    bytes = :binary.encode_unsigned(magnitude)

    if byte_size(bytes) > @bigint_max_bytes do
      raise ArgumentError,
            "cannot encode an integer of #{byte_size(bytes)} magnitude bytes, over the cap " <>
              "of #{@bigint_max_bytes} bytes of a big integer (ext 7)"
    end

    Msgpack.enc_ext(@bigint, [sign | bytes])
  end

  def encode_other(other, _h, _d) do
    raise ArgumentError,
          "cannot encode #{inspect(other, limit: 5)}: pids, ports, references and " <>
            "functions have no wire form"
  end

  # Maps of atom keys only, or of integer keys only, cannot collide in Python (an atom
  # becomes the str of its name, or None/True/False/a float for nil/true/false/:nan/...).
  @impl true
  def check_keys(pairs) do
    if Enum.all?(pairs, &is_atom(elem(&1, 0))) or Enum.all?(pairs, &is_integer(elem(&1, 0))),
      do: :ok,
      else: PyKeys.check!(pairs)
  end

  # -- decoding --------------------------------------------------------------

  @impl true
  def decode_ext(@atom, name, _depth), do: decode_atom(name)

  def decode_ext(@tuple, payload, depth) do
    case Decoder.decode_exact(payload, __MODULE__, depth) do
      list when is_list(list) -> List.to_tuple(list)
      _ -> Decoder.fail!("a tuple (ext 2) payload is not an array")
    end
  end

  def decode_ext(@tensor, payload, _depth), do: TensorExt.decode(payload)
  def decode_ext(@slot_tensor, payload, _depth), do: SlotExt.decode(payload)
  def decode_ext(@dataclass, payload, depth), do: Dataclass.decode(payload, __MODULE__, depth)

  def decode_ext(@enum, payload, depth) do
    case Decoder.decode_exact(payload, __MODULE__, depth) do
      [class, member] when is_binary(class) and is_binary(member) ->
        existing_atom_or_string(String.downcase(member))

      other ->
        Decoder.fail!("an enum (ext 5) payload must be [class, member], got #{short(other)}")
    end
  end

  def decode_ext(@ref, payload, depth) do
    case Decoder.decode_exact(payload, __MODULE__, depth) do
      [i, id, s, type]
      when is_binary(i) and is_integer(id) and (is_binary(s) or is_nil(s)) and is_binary(type) ->
        %Ref{instance: i, id: id, session: s, type: type, node: node()}

      other ->
        Decoder.fail!(
          "a reference (ext 6) payload must be [instance, id, session, type], got #{short(other)}"
        )
    end
  end

  def decode_ext(@bigint, <<_sign, magnitude::binary>>, _depth)
      when byte_size(magnitude) > @bigint_max_bytes do
    Decoder.fail!(
      "a big integer (ext 7) of #{byte_size(magnitude)} magnitude bytes is over the cap " <>
        "of #{@bigint_max_bytes} bytes"
    )
  end

  def decode_ext(@bigint, <<sign, magnitude::binary>>, _depth)
      when sign in [0, 1] and byte_size(magnitude) > 0 do
    n = :binary.decode_unsigned(magnitude)
    if sign == 1, do: -n, else: n
  end

  def decode_ext(@bigint, payload, _depth),
    do: Decoder.fail!("malformed big integer (ext 7) payload of #{byte_size(payload)} bytes")

  def decode_ext(type, _payload, _depth),
    do: Decoder.fail!("unknown extension type #{type}")

  # Atoms never come into existence from wire data. The lookup comes first (the common
  # case costs one call); only a name without an atom is checked for UTF-8.
  defp decode_atom(name) do
    :erlang.binary_to_existing_atom(name, :utf8)
  rescue
    _ in [ArgumentError, SystemLimitError] ->
      if is_binary(:unicode.characters_to_binary(name)),
        do: name,
        else: Decoder.fail!("an atom (ext 1) name is not valid UTF-8")
  end

  defp existing_atom_or_string(name) do
    :erlang.binary_to_existing_atom(name, :utf8)
  rescue
    _ in [ArgumentError, SystemLimitError] -> name
  end

  defp short(term), do: inspect(term, limit: 4, printable_limit: 60)
end
