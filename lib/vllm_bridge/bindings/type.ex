defmodule VllmBridge.Bindings.Type do
  @moduledoc false
  # Python type hints as the generated bindings use them: read from a manifest, written as a
  # typespec, and checked against an argument before it is sent.
  #
  # | Python hint (manifest `kind`) | descriptor | typespec |
  # |---|---|---|
  # | `Any`, no hint (`any`) | `:any` | `term()` |
  # | `None` (`none`) | `:none` | `nil` |
  # | `bool`, `int`, `float`, `str`, `bytes` | `:bool`, `:int`, `:float`, `:str`, `:bytes` | `boolean()`, `integer()`, `float()`, `String.t()`, `binary()` |
  # | `torch.Tensor`, `numpy.ndarray` (`tensor`) | `:tensor` | `VllmBridge.Tensor.t()` |
  # | `list[T]` | `{:list, t}` | `[t]` |
  # | `dict[K, V]` | `{:dict, k, v}` | `%{optional(k) => v}` |
  # | `tuple[A, B]` | `{:tuple, [a, b]}` | `{a, b}` |
  # | `tuple[T, ...]` | `{:tuple_of, t}` | `tuple()` |
  # | `A \\| B`, `Optional[A]` (`union`) | `{:union, [a, b]}` | `a \\| b` |
  # | a dataclass with a generated struct | `{:struct, module}` | `module.t()` |
  # | a dataclass without one | `{:object, class}` | `VllmBridge.Object.t()` |
  # | an enum | `{:enum, module, atoms}` | `module.t()` (a union of atoms) |
  # | `slice` | `:slice` | `{integer(), integer()} \\| VllmBridge.Ref.t()` |
  # | any other class (`ref`) | `{:ref, class}` | `VllmBridge.Ref.t()` |
  #
  # Checks (`check/2`) follow the typespec, with three allowances that Python makes too:
  # a `float` also takes an integer (and `:nan`, `:infinity`, `:neg_infinity`, the codec's
  # non-finite floats); a `slice` is sent as a `{start, stop}` pair (the worker's
  # `UBatchSlice` turns it into a slice) and comes back as one (a slice with a step comes
  # back as a reference); and any argument may
  # be a `%VllmBridge.Ref{}`, an object the worker holds, whose Python type only the worker
  # can check.

  alias VllmBridge.{Object, Ref, Tensor}

  @typedoc "A type descriptor (see the table)."
  @type t ::
          :any
          | :none
          | :bool
          | :int
          | :float
          | :str
          | :bytes
          | :tensor
          | :slice
          | {:list, t()}
          | {:dict, t(), t()}
          | {:tuple, [t()]}
          | {:tuple_of, t()}
          | {:union, [t()]}
          | {:struct, module()}
          | {:object, String.t()}
          | {:enum, module() | nil, [atom()]}
          | {:ref, String.t()}

  @typedoc "Python class name => Elixir module, for the classes that have generated modules."
  @type classes :: %{String.t() => module()}

  @plain %{
    "any" => :any,
    "none" => :none,
    "bool" => :bool,
    "int" => :int,
    "float" => :float,
    "str" => :str,
    "bytes" => :bytes,
    "tensor" => :tensor
  }

  @doc """
  The descriptor of a manifest type (a map with `"kind"`). `classes` maps the Python
  classes that have generated modules to them. Raises `ArgumentError` on an unknown kind.
  """
  @spec from_manifest(map(), classes()) :: t()
  def from_manifest(%{"kind" => kind}, _classes) when is_map_key(@plain, kind),
    do: Map.fetch!(@plain, kind)

  def from_manifest(%{"kind" => kind} = type, classes) do
    case kind do
      "list" ->
        {:list, from_manifest(type["item"], classes)}

      "dict" ->
        {:dict, from_manifest(type["key"], classes), from_manifest(type["value"], classes)}

      "tuple" ->
        tuple(type, classes)

      "union" ->
        {:union, Enum.map(type["of"], &from_manifest(&1, classes))}

      "dataclass" ->
        struct_or_object(type["class"], classes)

      "enum" ->
        {:enum, Map.get(classes, type["class"]), Enum.map(type["members"], &member_atom/1)}

      "ref" ->
        if type["class"] == "slice", do: :slice, else: {:ref, type["class"]}

      _ ->
        raise ArgumentError, "unknown type kind #{inspect(kind)} in #{inspect(type)}"
    end
  end

  def from_manifest(other, _classes),
    do: raise(ArgumentError, "not a manifest type: #{inspect(other)}")

  defp tuple(%{"items" => items}, classes),
    do: {:tuple, Enum.map(items, &from_manifest(&1, classes))}

  defp tuple(%{"item" => item}, classes), do: {:tuple_of, from_manifest(item, classes)}

  defp struct_or_object(class, classes) do
    case classes do
      %{^class => module} -> {:struct, module}
      _ -> {:object, class}
    end
  end

  @doc "The Elixir atom of an enum member: its name, lower-cased (`FULL` -> `:full`)."
  @spec member_atom(String.t()) :: atom()
  # Generation-time only: member names come from the manifest, a bounded, committed set.
  def member_atom(name) when is_binary(name), do: name |> String.downcase() |> String.to_atom()

  @doc "The typespec of a descriptor, as Elixir source text."
  @spec spec(t()) :: String.t()
  def spec(:any), do: "term()"
  def spec(:none), do: "nil"
  def spec(:bool), do: "boolean()"
  def spec(:int), do: "integer()"
  def spec(:float), do: "float()"
  def spec(:str), do: "String.t()"
  def spec(:bytes), do: "binary()"
  def spec(:tensor), do: "VllmBridge.Tensor.t()"
  def spec(:slice), do: "{integer(), integer()} | VllmBridge.Ref.t()"
  def spec({:list, t}), do: "[#{spec(t)}]"
  def spec({:dict, k, v}), do: "%{optional(#{spec(k)}) => #{spec(v)}}"
  def spec({:tuple, ts}), do: "{#{Enum.map_join(ts, ", ", &spec/1)}}"
  def spec({:tuple_of, _}), do: "tuple()"
  def spec({:union, ts}), do: ts |> Enum.map(&spec/1) |> Enum.uniq() |> Enum.join(" | ")
  def spec({:struct, module}), do: "#{inspect(module)}.t()"
  def spec({:object, _}), do: "VllmBridge.Object.t()"
  def spec({:enum, nil, atoms}), do: Enum.map_join(atoms, " | ", &inspect/1)
  def spec({:enum, module, _}), do: "#{inspect(module)}.t()"
  def spec({:ref, _}), do: "VllmBridge.Ref.t()"

  @doc "Whether `value` may be sent where Python expects the type (see the moduledoc)."
  @spec check(t(), term()) :: boolean()
  def check(_type, %Ref{}), do: true
  def check(:any, _), do: true
  def check(:none, v), do: v == nil
  def check(:bool, v), do: is_boolean(v)
  def check(:int, v), do: is_integer(v)
  def check(:float, v), do: is_float(v) or is_integer(v) or v in [:nan, :infinity, :neg_infinity]
  def check(:str, v), do: is_binary(v) and String.valid?(v)
  def check(:bytes, v), do: is_binary(v)
  def check(:tensor, v), do: is_struct(v, Tensor)
  def check(:slice, {a, b}), do: is_integer(a) and is_integer(b)
  def check(:slice, _), do: false
  def check({:list, t}, v), do: is_list(v) and all_list?(v, t)

  def check({:dict, k, t}, v) when is_map(v) and not is_struct(v),
    do: Enum.all?(v, fn {key, val} -> check(k, key) and check(t, val) end)

  def check({:dict, _, _}, _), do: false

  def check({:tuple, ts}, v),
    do: is_tuple(v) and tuple_size(v) == length(ts) and all_pairs?(Tuple.to_list(v), ts)

  def check({:tuple_of, t}, v), do: is_tuple(v) and all_list?(Tuple.to_list(v), t)
  def check({:union, ts}, v), do: Enum.any?(ts, &check(&1, v))
  def check({:struct, module}, v), do: is_struct(v, module)
  def check({:object, class}, v), do: match?(%Object{class: ^class}, v)
  def check({:enum, _, atoms}, v), do: is_atom(v) and v in atoms
  def check({:ref, _}, _), do: false

  defp all_list?([], _t), do: true
  defp all_list?([h | rest], t), do: check(t, h) and all_list?(rest, t)
  defp all_list?(_improper, _t), do: false

  defp all_pairs?([], []), do: true
  defp all_pairs?([v | vs], [t | ts]), do: check(t, v) and all_pairs?(vs, ts)
end
