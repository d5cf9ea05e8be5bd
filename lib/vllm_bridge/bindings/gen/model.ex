defmodule VllmBridge.Bindings.Gen.Model do
  @moduledoc false
  # The generator's view of a manifest: the functions, attributes and classes of one Python
  # module with Elixir names, type descriptors (`VllmBridge.Bindings.Type`) and markdown
  # docs, ready to be written out.
  #
  # Parameters take the mode of `VllmBridge.Bindings.Args` from their Python kind and
  # default. A `*args` parameter is left out (the binding passes no extra positional
  # arguments); `**kwargs` lets any option name through.

  alias VllmBridge.Bindings.{Naming, Type}
  alias VllmBridge.Bindings.Gen.Docs

  @typedoc "Python class name => `%{module: module, entry: manifest class}`."
  @type classes :: %{String.t() => %{module: module(), entry: map()}}

  @typedoc "A function to generate."
  @type function_model :: %{
          name: String.t(),
          module: module(),
          python: String.t(),
          target: {String.t(), String.t()},
          kind: :call | :enter | :get,
          doc: String.t(),
          sections: [{String.t(), String.t()}],
          params: [map()],
          var_keyword: boolean(),
          var_positional: String.t() | nil,
          returns: Type.t(),
          defined_in: String.t() | nil
        }

  @doc "The classes of all manifests, by Python class name, named by `naming`."
  @spec classes([map()], Naming.t()) :: classes()
  def classes(manifests, naming \\ Naming.library()) do
    for m <- manifests, c <- m["classes"], into: %{} do
      {c["class"], %{module: Naming.class_module(m["module"], c["name"], naming), entry: c}}
    end
  end

  @doc "Python class name => module, as `VllmBridge.Bindings.Type.from_manifest/2` takes it."
  @spec modules(classes()) :: Type.classes()
  def modules(classes), do: Map.new(classes, fn {class, %{module: m}} -> {class, m} end)

  @doc "A function (or method, alias) of a manifest, bound in `module`."
  @spec function(map(), String.t(), module(), classes()) :: function_model()
  def function(entry, python_module, module, classes) do
    types = modules(classes)
    %{body: doc, described: described, sections: sections} = Docs.parts(entry["doc"])
    owner = entry["kind"] in ["method", "property"]

    params =
      entry["params"]
      |> Enum.with_index()
      |> Enum.flat_map(fn {p, i} -> param(p, i == 0 and owner, types, described) end)

    fixed = Enum.filter(params, &(&1.mode in [:required, :required_keyword]))
    positional = Enum.filter(params, &(&1.mode in [:optional, :positional_only]))
    keyword = Enum.filter(params, &(&1.mode == :keyword))
    cm = entry["context_manager"] == true
    returns = if cm, do: entry["yields"], else: entry["returns"]

    %{
      name: Naming.function_name(entry["name"]),
      module: module,
      python: "#{python_module}.#{entry["path"]}",
      target: {python_module, entry["path"]},
      kind: if(cm, do: :enter, else: :call),
      doc: doc,
      sections: sections,
      params: fixed ++ positional ++ keyword,
      var_keyword: Enum.any?(entry["params"], &(&1["kind"] == "var_keyword")),
      var_positional:
        Enum.find_value(entry["params"], &(&1["kind"] == "var_positional" && &1["name"])),
      returns: Type.from_manifest(returns, types),
      defined_in: entry["defined_in"]
    }
  end

  @doc "A module attribute of a manifest, read by a function of `module`."
  @spec attribute(map(), String.t(), module(), classes()) :: function_model()
  def attribute(entry, python_module, module, classes) do
    live = if entry["live"], do: " (live: served by the module's `__getattr__`)", else: ""

    %{
      name: Naming.function_name(entry["name"]),
      module: module,
      python: "#{python_module}.#{entry["name"]}",
      target: {python_module, entry["name"]},
      kind: :get,
      doc: "Reads the Python module attribute `#{python_module}.#{entry["name"]}`#{live}.",
      sections: [],
      params: [],
      var_keyword: false,
      var_positional: nil,
      returns: Type.from_manifest(entry["type"], modules(classes)),
      defined_in: python_module
    }
  end

  defp param(%{"kind" => "var_positional"}, _self, _types, _described), do: []
  defp param(%{"kind" => "var_keyword"}, _self, _types, _described), do: []

  defp param(p, self?, types, described) do
    name = p["name"]
    type = Type.from_manifest(p["type"], types)

    var =
      case {self?, type} do
        {true, {:struct, m}} ->
          Naming.instance_name(m |> Module.split() |> List.last())

        {true, {:enum, m, _}} when m != nil ->
          Naming.instance_name(m |> Module.split() |> List.last())

        _ ->
          Naming.variable(name)
      end

    default = Map.fetch(p, "default")

    mode =
      case {p["kind"], default} do
        {"keyword_only", :error} -> :required_keyword
        {"keyword_only", {:ok, _}} -> :keyword
        {"positional_only", {:ok, _}} -> :positional_only
        {_, {:ok, _}} -> :optional
        {_, :error} -> :required
      end

    [
      %{
        py: name,
        var: var,
        mode: mode,
        type: type,
        default: default,
        doc: if(self?, do: "the instance", else: described[name])
      }
    ]
  end

  @doc "The spec map a generated module stores for `VllmBridge.Bindings` (see `Args`)."
  @spec binding_spec(function_model()) :: map()
  def binding_spec(fun) do
    base = %{
      name: "#{inspect(fun.module)}.#{fun.name}",
      target: fun.target,
      # A required parameter goes positionally: messages name it as the Elixir argument.
      params:
        Enum.map(fun.params, fn p ->
          name = if p.mode == :required, do: p.var, else: p.py
          {String.to_atom(name), p.mode, p.type}
        end)
    }

    if fun.var_keyword, do: Map.put(base, :var_keyword, true), else: base
  end
end
