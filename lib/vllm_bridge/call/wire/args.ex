defmodule VllmBridge.Call.Wire.Args do
  @moduledoc false
  # A call's arguments as msgpack, for VllmBridge.Call.Wire.encode_invoke/3 and
  # encode_invoke_binding/3 (encode_invoke/3 answers an ArgumentError raised here as a
  # :bad_argument): each
  # positional argument and each keyword's value encoded on its own (so that a value
  # that cannot travel is named by its place, `args[1]` or `kwargs["x"]`), the keywords
  # checked (a name given twice is refused, not overwritten) and written in key order,
  # the bytes `VllmBridge.Codec.encode/1` gives for the same list and map; and a
  # binding's target, encoded once.

  alias VllmBridge.{Codec, Error}
  alias VllmBridge.Codec.Msgpack

  @doc """
  The encoded target `["m", module, path]` of a generated binding, built once and kept in
  `:persistent_term` (`VllmBridge.Call.Wire.encode_invoke_binding/3`).
  """
  @spec binding_target(String.t(), String.t()) :: binary()
  def binding_target(module, path) do
    key = {__MODULE__, :binding_target, module, path}

    case :persistent_term.get(key, nil) do
      nil ->
        encoded = IO.iodata_to_binary(Codec.encode(["m", module, path]))
        :persistent_term.put(key, encoded)
        encoded

      encoded ->
        encoded
    end
  end

  @doc """
  The encoded args and kwargs of a call (`[]` for `nil, nil`: a `get`), or a
  `:bad_argument` naming the argument that cannot travel.
  """
  @spec encode(list() | nil, map() | keyword() | nil) :: {:ok, [iodata()]} | {:error, Error.t()}
  def encode(nil, nil), do: {:ok, []}

  def encode(args, kwargs) when is_list(args) do
    with {:ok, kw} <- kwargs(kwargs),
         {:ok, args_part} <- each_arg(args),
         {:ok, kw_part} <- each_kwarg(kw) do
      {:ok, [args_part, kw_part]}
    end
  end

  def encode(args, _kwargs),
    do: bad("args must be a list, got #{inspect(args, limit: 5)}")

  # The array of positional arguments, each one encoded on its own.
  defp each_arg(args) do
    n = proper_length(args)

    if n == nil do
      bad("args must be a proper list, got #{inspect(args, limit: 8)}")
    else
      {:ok, [Msgpack.enc_array_header(n) | encode_each(args, 0)]}
    end
  catch
    {:bad_arg, where, e} -> bad("#{where}: #{Exception.message(e)}")
  end

  defp encode_each([], _i), do: []

  defp encode_each([arg | rest], i),
    do: [encode_at(arg, fn -> "args[#{i}]" end) | encode_each(rest, i + 1)]

  # The map of keyword arguments (names already strings), values encoded on their own,
  # pairs in key order: the bytes Codec.encode/1 gives for the same map.
  defp each_kwarg(kw) when map_size(kw) == 0, do: {:ok, <<0x80>>}

  defp each_kwarg(kw) do
    pairs =
      for {k, v} <- Enum.sort(kw),
          do: [Codec.encode(k) | encode_at(v, fn -> "kwargs[#{inspect(k)}]" end)]

    {:ok, [Msgpack.enc_map_header(map_size(kw)) | pairs]}
  catch
    {:bad_arg, where, e} -> bad("#{where}: #{Exception.message(e)}")
  end

  defp encode_at(value, where) do
    Codec.encode(value)
  rescue
    e in ArgumentError -> throw({:bad_arg, where.(), e})
  end

  defp kwargs(nil), do: {:ok, %{}}
  defp kwargs(kw) when kw == %{} or kw == [], do: {:ok, %{}}

  defp kwargs(kw) when is_list(kw) and not is_map(kw) do
    if proper_length(kw) do
      kwargs_of(kw)
    else
      bad(
        "kwargs must be a map or a keyword list, got the improper list #{inspect(kw, limit: 8)}"
      )
    end
  end

  defp kwargs(kw) when is_map(kw), do: kwargs_of(kw)

  defp kwargs(other),
    do: bad("kwargs must be a map or a keyword list, got #{inspect(other, limit: 5)}")

  # A list's length, nil when it is improper (Enum would raise on its tail, and not an
  # ArgumentError).
  defp proper_length(list) do
    length(list)
  rescue
    ArgumentError -> nil
  end

  defp kwargs_of(kw) do
    Enum.reduce_while(kw, {:ok, %{}}, fn
      {k, v}, {:ok, acc} when is_atom(k) -> put_kwarg(acc, Atom.to_string(k), k, v)
      {k, v}, {:ok, acc} when is_binary(k) -> put_kwarg(acc, k, k, v)
      other, _ -> {:halt, bad("a keyword argument must be {name, value}, got #{inspect(other)}")}
    end)
  end

  defp put_kwarg(acc, name, given, value) do
    if Map.has_key?(acc, name) do
      {:halt,
       bad(
         "the keyword argument #{inspect(name)} is given twice (the second time as " <>
           "#{inspect(given)}); Python takes each name once"
       )}
    else
      {:cont, {:ok, Map.put(acc, name, value)}}
    end
  end

  defp bad(message), do: {:error, Error.new(:bad_argument, message)}
end
