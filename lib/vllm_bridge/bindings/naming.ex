defmodule VllmBridge.Bindings.Naming do
  @moduledoc """
  The naming rule of the generated bindings.

    * **Modules.** The Python package `vllm_bridge` becomes `Vllm`, and each further part
      of a module path is camel-cased: `vllm_bridge.forward_context` ->
      `Vllm.ForwardContext`. Its functions and attributes go to `<that>.Module`
      (`Vllm.ForwardContext.Module`).
    * **Classes.** A dataclass or enum `C` of that module becomes `<that>.C`
      (`Vllm.ForwardContext.BatchDescriptor`, `Vllm.Config.ParallelConfig`,
      `Vllm.Cudagraph.CUDAGraphMode`), except the class that carries the module's own
      name, which takes the module's name itself (`ForwardContext` of
      `vllm_bridge.forward_context` -> `Vllm.ForwardContext`).
    * **Functions** are named after the Python names, snake-cased (`UBatchSlices` ->
      `u_batch_slices`, `RUNTIME_MODES` -> `runtime_modes`); a context manager `cm` also
      gets `with_cm`. A method of a class is a function of the class's module, its first
      argument the instance, named after the class (`dp_metadata`).
    * **Files**: one module per file, a root plus the module name underscored
      (`lib/vllm/forward_context/module.ex`, `lib/vllm/forward_context.ex`). The root is
      `lib/`, except for the demo's modules (`vllm_bridge.demo` and below): their bindings
      are rooted in `demo/lib/`, which is compiled only in dev and test (`mix.exs`), as
      the rest of the demo.
  """

  @root "Vllm"
  @package "vllm_bridge"
  @demo_root "demo/lib"

  @doc "The Elixir module path (as a string) of a Python module."
  @spec base(String.t()) :: String.t()
  def base(python_module) do
    case String.split(python_module, ".") do
      [@package | rest] -> Enum.join([@root | Enum.map(rest, &Macro.camelize/1)], ".")
      _ -> raise ArgumentError, "#{inspect(python_module)} is not a module of #{@package}"
    end
  end

  @doc "The module of a Python module's functions and attributes."
  @spec functions_module(String.t()) :: module()
  def functions_module(python_module), do: Module.concat([base(python_module), "Module"])

  @doc "The module of a Python class (`module.QualName`, the class defined in `python_module`)."
  @spec class_module(String.t(), String.t()) :: module()
  def class_module(python_module, class_name) do
    base = base(python_module)

    if class_name == Macro.camelize(python_module |> String.split(".") |> List.last()),
      do: Module.concat([base]),
      else: Module.concat([base, class_name])
  end

  @doc "The Elixir function name of a Python name."
  @spec function_name(String.t()) :: String.t()
  def function_name(python_name) do
    {lead, rest} = split_underscores(python_name)
    lead <> Macro.underscore(rest)
  end

  @doc "The argument name of an instance (the class, snake-cased: `DPMetadata` -> `dp_metadata`)."
  @spec instance_name(String.t()) :: String.t()
  def instance_name(class_name), do: Macro.underscore(class_name)

  @reserved ~w(and or not in when fn do end catch rescue after else true false nil)

  @doc "A usable Elixir variable name for a Python parameter name (`end` -> `end_`)."
  @spec variable(String.t()) :: String.t()
  def variable(name) when name in @reserved, do: name <> "_"
  def variable("_" <> _ = name), do: "arg" <> name
  def variable(name), do: name

  @doc """
  The file of the generated module `module`, one of the bindings of `python_module`,
  relative to the project root.
  """
  @spec file(module(), String.t()) :: String.t()
  def file(module, python_module),
    do: Path.join(code_root(python_module), Macro.underscore(module) <> ".ex")

  @doc "The folder under which the bindings of `python_module` are written."
  @spec code_root(String.t()) :: String.t()
  def code_root(python_module) do
    if python_module == "#{@package}.demo" or
         String.starts_with?(python_module, "#{@package}.demo."),
       do: @demo_root,
       else: "lib"
  end

  @doc "Every folder a generated module may be written under (see `code_root/1`)."
  @spec code_roots() :: [String.t()]
  def code_roots, do: ["lib", @demo_root]

  @doc "The manifest file of a Python module, relative to the project root."
  @spec manifest_file(String.t()) :: String.t()
  def manifest_file(python_module), do: Path.join(["priv", "bindings", python_module <> ".json"])

  defp split_underscores(name) do
    rest = String.trim_leading(name, "_")
    {String.duplicate("_", byte_size(name) - byte_size(rest)), rest}
  end
end
