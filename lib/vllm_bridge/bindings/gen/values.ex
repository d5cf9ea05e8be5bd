defmodule VllmBridge.Bindings.Gen.Values do
  @moduledoc false
  # Manifest values (Python defaults, see `vllm_bridge.bridge.introspect.hints`) as Elixir source:
  # `None` -> `nil`, a tuple -> a tuple, a dict -> a map, an enum member -> its atom, a
  # dataclass instance -> its struct (fields that differ from the struct's defaults only).
  # A value with no data form (`{"repr": text}`) has no Elixir value: `source/2` gives
  # `:error`, and `doc/2` shows the Python text.

  alias VllmBridge.Bindings.Gen.Model
  alias VllmBridge.Bindings.Type

  @doc "Elixir source of a manifest value, or `:error` when it has none."
  @spec source(term(), Model.classes()) :: {:ok, String.t()} | :error
  def source(value, classes) do
    {:ok, src(value, classes)}
  catch
    :no_value -> :error
  end

  @doc "How a default reads in the docs: the Elixir source, else the Python text."
  @spec doc(term(), Model.classes()) :: String.t()
  def doc(value, classes) do
    case source(value, classes) do
      {:ok, text} -> "`#{text}`"
      :error -> "`#{python_text(value)}` (Python)"
    end
  end

  defp src(v, _) when is_nil(v) or is_boolean(v) or is_number(v) or is_binary(v), do: inspect(v)
  defp src(list, c) when is_list(list), do: "[" <> Enum.map_join(list, ", ", &src(&1, c)) <> "]"
  defp src(%{"tuple" => items}, c), do: "{" <> Enum.map_join(items, ", ", &src(&1, c)) <> "}"

  defp src(%{"dict" => pairs}, c),
    do: "%{" <> Enum.map_join(pairs, ", ", fn [k, v] -> "#{src(k, c)} => #{src(v, c)}" end) <> "}"

  defp src(%{"enum" => _, "member" => member}, _), do: inspect(Type.member_atom(member))

  defp src(%{"dataclass" => class, "fields" => fields}, classes) do
    case classes do
      %{^class => %{module: module, entry: entry}} ->
        changed =
          for f <- entry["fields"],
              Map.has_key?(fields, f["name"]),
              Map.get(f, "default", :none) != fields[f["name"]],
              do: "#{f["name"]}: #{src(fields[f["name"]], classes)}"

        "%#{inspect(module)}{#{Enum.join(changed, ", ")}}"

      _ ->
        pairs =
          Enum.map_join(fields, ", ", fn {k, v} -> "#{inspect(k)} => #{src(v, classes)}" end)

        "%VllmBridge.Object{class: #{inspect(class)}, fields: %{#{pairs}}}"
    end
  end

  defp src(%{"repr" => _}, _), do: throw(:no_value)

  defp python_text(%{"repr" => text}), do: text
  defp python_text(other), do: inspect(other)
end
