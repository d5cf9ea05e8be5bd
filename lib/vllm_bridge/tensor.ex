defmodule VllmBridge.Tensor do
  @moduledoc """
  A tensor by value (msgpack ext 3 of docs/PROTOCOL.md).

    * `dtype` - one of `dtypes/0` (PyTorch's names: `:float32`, `:bfloat16`, `:int64`, ...)
    * `shape` - a list of non-negative integers; `[]` is a scalar
    * `data` - the elements as raw bytes: C-contiguous (row-major), little-endian,
      `size(t) * itemsize(dtype)` bytes
    * `device` - where the tensor came from (`"cpu"`, `"cuda:0"`); informational, a tensor
      always travels by value

  The codec neither copies nor converts `data`: a decoded tensor's data is a sub-binary of
  the frame it arrived in (use `:binary.copy/1` to keep a small tensor from a big frame
  without keeping the frame alive), and encoding hands `data` to the port as it is.

  Elements in Elixir (`from_list/3`, `to_list/1`): integers for the integer dtypes,
  `true`/`false` for `:bool` (stored as the bytes 1 and 0, the only bytes a bool tensor
  may hold), floats for the float dtypes (with `:nan`, `:infinity` and
  `:neg_infinity` for the values Erlang floats cannot hold), and `{re, im}` tuples of such
  floats for the complex dtypes. Converting to `:float16`, `:bfloat16` and `:float32`
  rounds to the nearest value, ties to even, as PyTorch does; beyond the dtype's range the
  value becomes an infinity.
  """

  import Bitwise, only: [&&&: 2]

  alias VllmBridge.Tensor.Elements

  @enforce_keys [:dtype, :shape, :data]
  defstruct dtype: nil, shape: [], data: <<>>, device: "cpu"

  @typedoc "The element types of docs/PROTOCOL.md."
  @type dtype ::
          :bool
          | :uint8
          | :int8
          | :int16
          | :int32
          | :int64
          | :float16
          | :bfloat16
          | :float32
          | :float64
          | :complex64
          | :complex128
          | :uint16
          | :uint32
          | :uint64

  @typedoc "An element as `to_list/1` gives it and `from_list/3` takes it."
  @type element ::
          integer() | float() | boolean() | :nan | :infinity | :neg_infinity | {term(), term()}

  @type t :: %__MODULE__{
          dtype: dtype(),
          shape: [non_neg_integer()],
          data: binary(),
          device: String.t()
        }

  # {dtype, wire code, itemsize}: the table of docs/PROTOCOL.md.
  @table [
    {:bool, 0, 1},
    {:uint8, 1, 1},
    {:int8, 2, 1},
    {:int16, 3, 2},
    {:int32, 4, 4},
    {:int64, 5, 8},
    {:float16, 6, 2},
    {:bfloat16, 7, 2},
    {:float32, 8, 4},
    {:float64, 9, 8},
    {:complex64, 10, 8},
    {:complex128, 11, 16},
    {:uint16, 12, 2},
    {:uint32, 13, 4},
    {:uint64, 14, 8}
  ]

  @dtypes for {name, _, _} <- @table, do: name

  @doc "The dtypes a tensor can have, in the order of their wire codes."
  @spec dtypes() :: [dtype()]
  def dtypes, do: @dtypes

  @doc "Bytes per element of `dtype`; raises `ArgumentError` for an unknown dtype."
  @spec itemsize(dtype()) :: pos_integer()
  for {name, _code, size} <- @table, do: def(itemsize(unquote(name)), do: unquote(size))
  def itemsize(other), do: raise(ArgumentError, unknown_dtype(other))

  @doc false
  # The wire code of a dtype.
  @spec code(dtype()) :: non_neg_integer()
  for {name, code, _size} <- @table, do: def(code(unquote(name)), do: unquote(code))
  def code(other), do: raise(ArgumentError, unknown_dtype(other))

  @doc false
  # The dtype of a wire code, or :error.
  @spec from_code(integer()) :: {:ok, dtype()} | :error
  for {name, code, _size} <- @table, do: def(from_code(unquote(code)), do: {:ok, unquote(name)})
  def from_code(_), do: :error

  @doc "The number of elements: the product of the shape (1 for a scalar)."
  @spec size(t()) :: non_neg_integer()
  def size(%__MODULE__{shape: shape}), do: prod(shape)

  @doc "The number of bytes of the data."
  @spec nbytes(t()) :: non_neg_integer()
  def nbytes(%__MODULE__{data: data}), do: byte_size(data)

  @doc """
  Builds a tensor from raw little-endian, C-contiguous `data` (not copied).

  Raises `ArgumentError` naming the bad value when `dtype` is unknown, `shape` is not a list
  of non-negative integers, the data size is not `product(shape) * itemsize(dtype)`, or
  `:bool` data holds a byte other than 0 and 1.
  Option: `:device` (default `"cpu"`).
  """
  @spec new(binary(), dtype(), [non_neg_integer()], keyword()) :: t()
  def new(data, dtype, shape, opts \\ []) do
    validate!(%__MODULE__{
      dtype: dtype,
      shape: shape,
      data: data,
      device: Keyword.get(opts, :device, "cpu")
    })
  end

  @doc """
  Builds a tensor of `dtype` from a nested list (its shape is the nesting: `[[1, 2], [3,
  4]]` is 2 x 2), or from a flat list with the `:shape` option, or from one element (a
  scalar, shape `[]`).

  Raises `ArgumentError` naming the element that does not fit the dtype (an integer out of
  range, a float for an integer dtype, ...) or the list that breaks the shape. Options:
  `:shape`, `:device` (default `"cpu"`).
  """
  @spec from_list(element() | list(), dtype(), keyword()) :: t()
  def from_list(values, dtype, opts \\ []) do
    _ = itemsize(dtype)

    {shape, data} =
      case Keyword.fetch(opts, :shape) do
        {:ok, shape} ->
          check_shape!(shape)
          flat = if is_list(values), do: List.flatten(values), else: [values]

          if length(flat) != prod(shape) do
            raise ArgumentError,
                  "#{length(flat)} values do not fill shape #{inspect(shape)} " <>
                    "(#{prod(shape)} elements)"
          end

          {shape, Elements.pack(flat, dtype)}

        :error ->
          shape = infer_shape(values)
          {shape, Elements.pack_nested(values, shape, dtype)}
      end

    new(data, dtype, shape, Keyword.take(opts, [:device]))
  end

  @doc """
  The elements as a list nested by the shape (a scalar tensor gives its one element).
  See the module doc for how each dtype's elements look.
  """
  @spec to_list(t()) :: element() | list()
  def to_list(%__MODULE__{} = t) do
    t = validate!(t)
    nest(t.data, t.shape, t.dtype)
  end

  @doc "The elements as a flat list, in C (row-major) order."
  @spec to_flat_list(t()) :: [element()]
  def to_flat_list(%__MODULE__{} = t) do
    t = validate!(t)
    Elements.unpack(t.data, t.dtype)
  end

  @doc false
  # Checks every field; returns the tensor or raises ArgumentError naming the bad value.
  @spec validate!(t()) :: t()
  def validate!(%__MODULE__{dtype: dtype, shape: shape, data: data, device: device} = t) do
    size = itemsize(dtype)
    check_shape!(shape)

    unless is_binary(data),
      do: raise(ArgumentError, "tensor data must be a binary, got #{inspect(data, limit: 5)}")

    unless is_binary(device),
      do: raise(ArgumentError, "tensor device must be a string, got #{inspect(device)}")

    expected = prod(shape) * size

    if byte_size(data) != expected do
      raise ArgumentError,
            "tensor data is #{byte_size(data)} bytes but shape #{inspect(shape)} of " <>
              "#{dtype} (#{size} bytes each) needs #{expected}"
    end

    if dtype == :bool do
      with {offset, byte} <- bad_bool_byte(data) do
        raise ArgumentError,
              "bool tensor data holds the byte #{byte} at offset #{offset}; bool bytes " <>
                "must be 0 or 1"
      end
    end

    t
  end

  @non_bool_bytes for b <- 2..255, do: <<b>>
  @chunk 65_536
  @bool_mask :binary.decode_unsigned(:binary.copy(<<0xFE>>, @chunk))

  @doc false
  # The first byte of bool data that is neither 0 nor 1, as {offset, byte}, or nil.
  # Chunks are checked as big integers against a 0xFE.. mask (about twice as fast as
  # :binary.match/2 with 254 patterns); only a failing chunk is searched byte-wise.
  @spec bad_bool_byte(binary()) :: {non_neg_integer(), byte()} | nil
  def bad_bool_byte(data), do: bad_bool_byte(data, 0)

  defp bad_bool_byte(<<chunk::binary-size(@chunk), rest::binary>>, offset) do
    if (:binary.decode_unsigned(chunk) &&& @bool_mask) == 0,
      do: bad_bool_byte(rest, offset + @chunk),
      else: first_bad_byte(chunk, offset)
  end

  defp bad_bool_byte(rest, offset) do
    if (:binary.decode_unsigned(rest) &&& @bool_mask) == 0,
      do: nil,
      else: first_bad_byte(rest, offset)
  end

  defp first_bad_byte(chunk, offset) do
    {at, 1} = :binary.match(chunk, @non_bool_bytes)
    {offset + at, :binary.at(chunk, at)}
  end

  defp check_shape!(shape) do
    unless is_list(shape) and Enum.all?(shape, &(is_integer(&1) and &1 >= 0)) do
      raise ArgumentError,
            "tensor shape must be a list of non-negative integers, got #{inspect(shape)}"
    end
  end

  defp prod(shape), do: Enum.reduce(shape, 1, &(&1 * &2))

  defp infer_shape([]), do: [0]
  defp infer_shape([first | _] = l), do: [length(l) | infer_shape(first)]
  defp infer_shape(_element), do: []

  defp nest(data, [], dtype), do: hd(Elements.unpack(data, dtype))
  defp nest(data, [_n], dtype), do: Elements.unpack(data, dtype)
  defp nest(_data, [0 | _], _dtype), do: []

  defp nest(data, [n | rest], dtype) do
    stride = div(byte_size(data), n)
    for i <- 0..(n - 1), do: nest(binary_part(data, i * stride, stride), rest, dtype)
  end

  defp unknown_dtype(other),
    do: "unknown tensor dtype #{inspect(other)}; known: #{inspect(@dtypes)}"
end
