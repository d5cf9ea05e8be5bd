defmodule VllmBridge.Codec.Registry do
  @moduledoc """
  Which Elixir struct stands for which Python dataclass (msgpack ext 4).

  A struct module takes part by defining `__python_class__/0` (the qualified Python class
  name, `"vllm_bridge.forward_context.BatchDescriptor"`) and `__python_fields__/0` (its
  field atoms in Python declaration order). When it starts, the application scans its own
  modules and those of every loaded application that depends on `:vllm_bridge` (a user's
  app with its generated bindings, `mix vllm.gen.bindings --module ...`) for them
  (`load_dependents/0`); an app loaded later is added with `load/1`, a module compiled or
  loaded later with `register/1`. When two modules claim one class, the last registered
  wins.

  The table lives in `:persistent_term`: lookups cost no message and no copy, updates are
  rare (start-up, tests). Decoding consults only this table, so a class name arriving on
  the wire never loads a module nor creates an atom.
  """

  require Logger

  alias VllmBridge.Codec.Msgpack

  @key {__MODULE__, :classes}

  @typedoc "What the codec needs to know of one registered struct."
  @type entry :: %{
          module: module(),
          class: String.t(),
          fields: [atom()],
          by_name: %{String.t() => atom()},
          names: %{atom() => iodata()},
          wire_class: iodata()
        }

  @doc """
  Registers every module of `app` (default `:vllm_bridge`) that declares a Python class.
  Returns the number of modules registered; a module whose declaration is wrong is logged
  and skipped.
  """
  @spec load(atom()) :: non_neg_integer()
  def load(app \\ :vllm_bridge) do
    modules =
      case :application.get_key(app, :modules) do
        {:ok, modules} -> modules
        :undefined -> []
      end

    entries = for m <- modules, python_struct?(m), entry = checked_entry(m), do: entry
    update(fn classes -> Enum.reduce(entries, classes, &Map.put(&2, &1.class, &1)) end)
    length(entries)
  end

  @doc """
  Registers the modules of `:vllm_bridge` and of every loaded application that lists it
  among its `applications` (or `included_applications`): what the application does when
  it starts. Returns the number of modules registered.
  """
  @spec load_dependents() :: non_neg_integer()
  def load_dependents do
    dependents =
      for {app, _, _} <- :application.loaded_applications(),
          app != :vllm_bridge,
          depends?(app),
          do: app

    Enum.reduce([:vllm_bridge | Enum.sort(dependents)], 0, &(load(&1) + &2))
  end

  defp depends?(app) do
    Enum.any?([:applications, :included_applications], fn key ->
      case :application.get_key(app, key) do
        {:ok, apps} -> :vllm_bridge in apps
        :undefined -> false
      end
    end)
  end

  @doc """
  Registers one struct module. Raises `ArgumentError` naming the module unless it is a
  struct defining `__python_class__/0` (a string) and `__python_fields__/0` (a list of its
  own fields).
  """
  @spec register(module()) :: :ok
  def register(module) when is_atom(module) do
    unless python_struct?(module) do
      raise ArgumentError,
            "#{inspect(module)} is not a struct module defining __python_class__/0 " <>
              "and __python_fields__/0"
    end

    entry = build_entry(module)
    update(&Map.put(&1, entry.class, entry))
  end

  @doc "The registered entry of a Python class name."
  @spec lookup(String.t()) :: {:ok, entry()} | :error
  def lookup(class) when is_binary(class), do: Map.fetch(classes(), class)

  @doc "Every registered class name with its module."
  @spec registered() :: %{String.t() => module()}
  def registered, do: Map.new(classes(), fn {class, e} -> {class, e.module} end)

  @doc """
  The entry of a struct module, from the table when registered, else read from the module
  itself (so that a struct encodes even before it is registered). Raises `ArgumentError`
  for a module that declares no Python class.
  """
  @spec entry(module()) :: entry()
  def entry(module) do
    case :persistent_term.get({__MODULE__, :module, module}, nil) do
      nil -> build_entry(module)
      entry -> entry
    end
  end

  defp classes do
    case :persistent_term.get(@key, nil) do
      nil ->
        # Not loaded yet (the application is not started): load on first use.
        load_dependents()
        :persistent_term.get(@key, %{})

      classes ->
        classes
    end
  end

  # Read-modify-write under a node-local lock, so concurrent registrations are not lost.
  defp update(fun) do
    :global.trans(
      {{__MODULE__, :lock}, self()},
      fn ->
        classes = fun.(:persistent_term.get(@key, %{}))
        :persistent_term.put(@key, classes)

        for {_class, entry} <- classes,
            :persistent_term.get({__MODULE__, :module, entry.module}, nil) != entry,
            do: :persistent_term.put({__MODULE__, :module, entry.module}, entry)
      end,
      [node()]
    )

    :ok
  end

  defp python_struct?(module) do
    Code.ensure_loaded?(module) and function_exported?(module, :__python_class__, 0) and
      function_exported?(module, :__python_fields__, 0) and
      function_exported?(module, :__struct__, 0)
  end

  # A module that declares its Python class wrongly is left out with a warning: one bad
  # module must not stop the application.
  defp checked_entry(module) do
    build_entry(module)
  rescue
    e in ArgumentError ->
      Logger.warning("VllmBridge.Codec.Registry: #{Exception.message(e)}; not registered")
      nil
  end

  defp build_entry(module) do
    unless python_struct?(module) do
      raise ArgumentError, "#{inspect(module)} declares no Python class (__python_class__/0)"
    end

    class = module.__python_class__()
    fields = module.__python_fields__()
    struct_keys = module.__struct__() |> Map.keys() |> MapSet.new()

    unless is_binary(class) and is_list(fields) and
             Enum.all?(fields, &(is_atom(&1) and MapSet.member?(struct_keys, &1))) do
      raise ArgumentError,
            "#{inspect(module)}: __python_class__/0 must be a string and __python_fields__/0 " <>
              "a list of its struct fields, got #{inspect(class)} and #{inspect(fields)}"
    end

    %{
      module: module,
      class: class,
      fields: fields,
      by_name: Map.new(fields, &{Atom.to_string(&1), &1}),
      # The msgpack str of each field name and of the class name, encoded once.
      names: Map.new(fields, &{&1, Msgpack.enc_str(Atom.to_string(&1))}),
      wire_class: Msgpack.enc_str(class)
    }
  end
end
