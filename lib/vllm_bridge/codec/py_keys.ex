defmodule VllmBridge.Codec.PyKeys do
  @moduledoc false
  # How a Python dict sees the keys of an Elixir map, so that the codec can refuse before
  # sending what Python would refuse (a key it cannot hash) or change silently (two keys
  # it holds equal: it would keep one). The worker checks the same again on arrival
  # (python/vllm_bridge/bridge/protocol/decoder.py), with the same words.
  #
  # Each key maps to its Python identity: two keys with the same identity are one dict
  # key in Python. true/false are the ints 1/0; a float with an integral value is that
  # integer (1.0 == 1, -0.0 == 0); an atom is the str of its name; a UTF-8 binary is a str
  # and any other binary (or %VllmBridge.Bytes{}) is bytes; a tuple is its elements'
  # identities; a dataclass value, a struct of a module that declares its Python class
  # (registered or not: the encoder encodes both) or a %VllmBridge.Object{}, is its class
  # and its fields' names and identities, sorted by name, so that a struct and an Object
  # of one class with equal fields are one key, as they are one dataclass in Python.
  # Lists and maps are unhashable, and so is a tuple or struct holding one.
  # NaN, tensors and refs to objects are hashed by identity in Python: never equal here
  # (Python may still find two references to one object equal; it says so itself).
  #
  # What Elixir cannot know, the worker checks on arrival: whether a dataclass is frozen
  # (one that is not cannot be hashed: a struct key of it is refused there), and the
  # fields an Object leaves to their defaults.

  alias VllmBridge.{Bytes, Object, Ref, Tensor}
  alias VllmBridge.Codec.Registry

  @doc false
  # Raises ArgumentError naming the first unhashable key or the first two equal keys.
  @spec check!([{term(), term()}]) :: :ok
  def check!(pairs) do
    Enum.reduce(pairs, %{}, fn {key, _}, seen ->
      id = identity(key, key)

      case seen do
        %{^id => other} ->
          raise ArgumentError,
                "the map keys #{inspect(other, limit: 5)} and #{inspect(key, limit: 5)} are " <>
                  "equal in Python (#{why(other, key)}), so a dict would keep only one of " <>
                  "them: give each its own key"

        _ ->
          Map.put(seen, id, key)
      end
    end)

    :ok
  end

  defp identity(true, _top), do: 1
  defp identity(false, _top), do: 0
  defp identity(nil, _top), do: :none
  defp identity(i, _top) when is_integer(i), do: i
  defp identity(:nan, _top), do: {:nan, make_ref()}
  defp identity(:infinity, _top), do: {:float, :infinity}
  defp identity(:neg_infinity, _top), do: {:float, :neg_infinity}
  defp identity(a, _top) when is_atom(a), do: {:str, Atom.to_string(a)}

  defp identity(f, _top) when is_float(f) do
    t = trunc(f)
    if t == f, do: t, else: {:float, f}
  end

  defp identity(b, _top) when is_binary(b) do
    if is_binary(:unicode.characters_to_binary(b)), do: {:str, b}, else: {:bytes, b}
  end

  defp identity(%Bytes{data: d}, _top), do: {:bytes, d}
  defp identity(%Ref{instance: i, id: id}, _top), do: {:ref, i, id}
  defp identity(%Tensor{}, _top), do: {:object, make_ref()}

  defp identity(%Object{class: class, fields: fields}, top) when is_map(fields),
    do: dataclass(class, Enum.map(fields, fn {name, v} -> {name, identity(v, top)} end))

  defp identity(%module{} = struct, top) do
    case python_entry(module) do
      {:ok, entry} ->
        dataclass(
          entry.class,
          Enum.map(entry.fields, &{Atom.to_string(&1), identity(Map.fetch!(struct, &1), top)})
        )

      # Not a dataclass value (or a malformed Object): the encoder refuses it by name.
      :error ->
        {:object, make_ref()}
    end
  end

  defp identity(t, top) when is_tuple(t),
    do: {:tuple, t |> Tuple.to_list() |> Enum.map(&identity(&1, top))}

  defp identity(l, top) when is_list(l), do: unhashable(top, l, "a list")
  defp identity(m, top) when is_map(m), do: unhashable(top, m, "a map")
  # Pids, functions, ...: the encoder refuses them by name when it reaches them.
  defp identity(_other, _top), do: {:object, make_ref()}

  # One shape for a struct and an Object: field names are unique, so the sort is by name.
  defp dataclass(class, fields), do: {:dataclass, class, Enum.sort(fields)}

  # The entry the encoder uses too (VllmBridge.Codec.Dataclass): registered or not.
  defp python_entry(module) do
    {:ok, Registry.entry(module)}
  rescue
    ArgumentError -> :error
  end

  defp unhashable(top, inner, kind) do
    where = if top == inner, do: "is #{kind}", else: "holds #{kind} (#{inspect(inner, limit: 3)})"

    raise ArgumentError,
          "the map key #{inspect(top, limit: 5)} #{where}: Python cannot hash it, so it " <>
            "cannot be a dict key (a tuple of plain values can be)"
  end

  defp why(a, b) when is_boolean(a) or is_boolean(b), do: "true == 1 and false == 0"

  defp why(a, b) when is_number(a) and is_number(b),
    do: "a float equal to an integer is that integer"

  defp why(a, b) when (is_atom(a) and is_binary(b)) or (is_binary(a) and is_atom(b)),
    do: "an atom arrives as the string of its name"

  defp why(a, b) when is_tuple(a) and is_tuple(b), do: "their elements are equal in Python"

  defp why(a, b) when is_struct(a) and is_struct(b),
    do: "dataclasses of one class with fields equal in Python are equal"

  defp why(_a, _b), do: "Python compares them equal"
end
