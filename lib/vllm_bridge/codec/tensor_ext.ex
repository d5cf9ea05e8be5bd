defmodule VllmBridge.Codec.TensorExt do
  @moduledoc false
  # The tensor extension (ext 3 of docs/PROTOCOL.md): a binary header (dtype code, ndim,
  # device name, the shape as big-endian u64s), then the raw little-endian data.
  #
  # Zero-copy both ways: encoding puts the tensor's data binary into the iodata as it is,
  # decoding returns the data as a sub-binary of the payload. The header is checked against
  # the bytes present before anything is built: an unknown dtype code, a shape that does not
  # fit, data of the wrong size, or bool data with a byte other than 0 and 1 is a decode
  # error.

  alias VllmBridge.Codec.{Msgpack, SlotExt}
  alias VllmBridge.Codec.Msgpack.Decoder
  alias VllmBridge.{Shm, Tensor}

  @type_code 3

  @doc "The ext 3 value of a tensor, as iodata; raises `ArgumentError` naming a bad field."
  @spec encode(Tensor.t()) :: iodata()
  def encode(%Tensor{} = t) do
    %Tensor{dtype: dtype, shape: shape, data: data, device: device} = Tensor.validate!(t)
    dev = if device == "cpu", do: "", else: device
    ndim = length(shape)

    cond do
      byte_size(dev) > 255 ->
        raise ArgumentError, "tensor device name #{inspect(device)} is over 255 bytes"

      ndim > 255 ->
        raise ArgumentError, "a tensor of #{ndim} dimensions is over the limit of 255"

      Enum.any?(shape, &(&1 > 0xFFFFFFFFFFFFFFFF)) ->
        raise ArgumentError, "tensor shape #{inspect(shape)} has a dimension over 2^64 - 1"

      true ->
        # A large tensor inside VllmBridge.Shm.scope/2 goes into a slot (ext 8).
        case Shm.put(data) do
          {:ok, slot} ->
            SlotExt.encode(t, slot)

          :pipe ->
            head = [
              Tensor.code(dtype),
              ndim,
              byte_size(dev),
              dev | for(d <- shape, do: <<d::64>>)
            ]

            size = 3 + byte_size(dev) + 8 * ndim + byte_size(data)
            [Msgpack.ext_header(@type_code, size), head | data]
        end
    end
  end

  @doc "Decodes an ext 3 payload; a malformed one aborts the decode (`Decoder.fail!/1`)."
  @spec decode(binary()) :: Tensor.t()
  def decode(<<code, ndim, len, dev::binary-size(len), rest::binary>>) do
    dtype =
      case Tensor.from_code(code) do
        {:ok, dtype} -> dtype
        :error -> Decoder.fail!("unknown tensor dtype code #{code}")
      end

    shape_bytes = 8 * ndim

    case rest do
      <<shape_bin::binary-size(shape_bytes), data::binary>> ->
        shape = for <<d::64 <- shape_bin>>, do: d
        expected = Enum.reduce(shape, 1, &(&1 * &2)) * Tensor.itemsize(dtype)

        if byte_size(data) != expected do
          Decoder.fail!(
            "tensor data is #{byte_size(data)} bytes but shape #{inspect(shape)} of " <>
              "#{dtype} needs #{expected}"
          )
        end

        if dtype == :bool, do: check_bool(data)
        %Tensor{dtype: dtype, shape: shape, data: data, device: device(dev)}

      _ ->
        Decoder.fail!(
          "tensor header declares #{ndim} dimensions (#{shape_bytes} bytes) but " <>
            "#{byte_size(rest)} bytes follow"
        )
    end
  end

  def decode(payload),
    do: Decoder.fail!("truncated tensor header (#{byte_size(payload)} bytes)")

  @doc false
  # Shared with VllmBridge.Codec.SlotExt (ext 8 carries ext 3's header): a bool tensor's
  # bytes are 0 or 1, and a device name is UTF-8 ("" read as "cpu").
  @spec check_bool(binary()) :: nil
  def check_bool(data) do
    with {offset, byte} <- Tensor.bad_bool_byte(data),
         do: Decoder.fail!("bool tensor data holds the byte #{byte} at offset #{offset}")
  end

  @doc false
  @spec device(binary()) :: String.t()
  def device(""), do: "cpu"

  def device(name) do
    if is_binary(:unicode.characters_to_binary(name)),
      do: name,
      else: Decoder.fail!("tensor device name is not valid UTF-8")
  end
end
