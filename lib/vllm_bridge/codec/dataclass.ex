defmodule VllmBridge.Codec.Dataclass do
  @moduledoc false
  # The dataclass extension (ext 4 of docs/PROTOCOL.md): `[qualified_class_name, {field:
  # value, ...}]` with the fields in declaration order.
  #
  # Encoding: a struct whose module declares `__python_class__/0` and `__python_fields__/0`
  # (see `VllmBridge.Codec.Registry`) emits its fields in the declared order, byte for byte
  # what Python emits; a `VllmBridge.Object` emits its fields in the order they arrived.
  #
  # Decoding: a class registered in `VllmBridge.Codec.Registry` becomes its struct (a field
  # the struct does not declare is a decode error; a field not sent keeps the struct's
  # default); any other class becomes a `VllmBridge.Object`. No atom is created and no
  # module is loaded from wire data.

  alias VllmBridge.Codec.{Msgpack, Registry}
  alias VllmBridge.Codec.Msgpack.Decoder
  alias VllmBridge.Object

  @doc """
  The ext 4 payload of a registered-class struct, as iodata; its field values may nest
  `depth` levels (see `VllmBridge.Codec.Msgpack`).
  """
  @spec encode_struct(struct(), module(), non_neg_integer()) :: iodata()
  def encode_struct(%module{} = struct, handler, depth) do
    entry =
      try do
        Registry.entry(module)
      rescue
        e in ArgumentError ->
          reraise ArgumentError,
                  "cannot encode #{inspect(struct, limit: 5)}: #{Exception.message(e)}",
                  __STACKTRACE__
      end

    fields =
      for f <- entry.fields,
          do: [entry.names[f] | Msgpack.encode_nested(Map.fetch!(struct, f), handler, depth)]

    [0x92, entry.wire_class, Msgpack.enc_map_header(length(entry.fields)) | fields]
  end

  @doc "The ext 4 payload of a `VllmBridge.Object`, as iodata (fields nest `depth` levels)."
  @spec encode_object(Object.t(), module(), non_neg_integer()) :: iodata()
  def encode_object(%Object{class: class, fields: fields, field_order: order} = o, handler, depth)
      when is_binary(class) and is_map(fields) and is_list(order) do
    check_names!(o)
    ordered = order |> Enum.filter(&Map.has_key?(fields, &1)) |> Enum.uniq()
    keys = ordered ++ Enum.sort(Map.keys(fields) -- ordered)

    pairs =
      for k <- keys,
          do: [
            Msgpack.encode_nested(k, handler, depth)
            | Msgpack.encode_nested(Map.fetch!(fields, k), handler, depth)
          ]

    [0x92, Msgpack.enc_str(class), Msgpack.enc_map_header(length(keys)) | pairs]
  end

  def encode_object(bad, _handler, _depth) do
    raise ArgumentError,
          "cannot encode #{inspect(bad, limit: 5)}: class must be a string, fields a map " <>
            "and field_order a list"
  end

  # Python takes a dataclass's field names as str only (and would refuse the frame
  # without saying where): anything else is refused here, by name.
  defp check_names!(%Object{fields: fields} = o) do
    case Enum.find(Map.keys(fields), &(not (is_binary(&1) and String.valid?(&1)))) do
      nil ->
        :ok

      bad ->
        raise ArgumentError,
              "cannot encode #{inspect(o, limit: 5)}: its field names must be strings " <>
                "(UTF-8), got #{inspect(bad, limit: 5)}"
    end
  end

  @doc "Decodes an ext 4 payload; a malformed one aborts the decode (`Decoder.fail!/1`)."
  @spec decode(binary(), module(), non_neg_integer()) :: struct()
  def decode(payload, handler, depth) do
    {class, r} =
      case Decoder.array_header(payload) do
        {2, r} -> Decoder.decode_one(r, handler, depth)
        {n, _} -> Decoder.fail!("a dataclass (ext 4) payload is an array of #{n}, not 2")
      end

    unless is_binary(class), do: Decoder.fail!("a dataclass (ext 4) class name is not a string")
    {n, r} = Decoder.map_header(r)
    pairs = read_pairs(r, n, [], handler, depth)

    if map_size(Map.new(pairs)) != n,
      do: Decoder.fail!("dataclass #{class} repeats a field")

    case Registry.lookup(class) do
      {:ok, entry} ->
        build(entry, pairs)

      :error ->
        %Object{class: class, fields: Map.new(pairs), field_order: Enum.map(pairs, &elem(&1, 0))}
    end
  end

  defp read_pairs(<<>>, 0, acc, _handler, _depth), do: :lists.reverse(acc)

  defp read_pairs(_r, 0, _acc, _handler, _depth),
    do: Decoder.fail!("trailing bytes in a dataclass (ext 4) payload")

  defp read_pairs(r, n, acc, handler, depth) do
    {k, r} = Decoder.decode_one(r, handler, depth)
    unless is_binary(k), do: Decoder.fail!("a dataclass (ext 4) field name is not a string")
    {v, r} = Decoder.decode_one(r, handler, depth)
    read_pairs(r, n - 1, [{k, v} | acc], handler, depth)
  end

  defp build(entry, pairs) do
    Enum.reduce(pairs, struct(entry.module), fn {name, value}, acc ->
      case entry.by_name do
        %{^name => field} ->
          Map.put(acc, field, value)

        _ ->
          Decoder.fail!("#{entry.class} has no field #{inspect(name)} (#{inspect(entry.module)})")
      end
    end)
  end
end
