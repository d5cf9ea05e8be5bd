defmodule VllmBridge.Bindings.Naming do
  @moduledoc """
  The naming rule of the generated bindings (`mix vllm.gen.bindings`), one rule for the
  library's own modules and for a user's.

    * **Modules.** A Python module's **base** is the prefix followed by each part of the
      module path, camel-cased. For a user's modules (`--module my_model --prefix MyApp.Py`)
      every part counts: `my_model` -> `MyApp.Py.MyModel`, `pkg.sub` -> `MyApp.Py.Pkg.Sub`.
      For the library the package `vllm_bridge` is the prefix `Vllm` itself:
      `vllm_bridge.forward_context` -> `Vllm.ForwardContext`. A module's functions and
      attributes go to `<base>.Module` (`MyApp.Py.MyModel.Module`,
      `Vllm.ForwardContext.Module`).
    * **Classes.** A dataclass or enum `C` of that module becomes `<base>.C`
      (`MyApp.Py.MyModel.Cfg`, `Vllm.ForwardContext.BatchDescriptor`,
      `Vllm.Cudagraph.CUDAGraphMode`), except the class that carries the module's own
      name, which takes the base itself (`MyModel` of `my_model` -> `MyApp.Py.MyModel`,
      `ForwardContext` of `vllm_bridge.forward_context` -> `Vllm.ForwardContext`).
    * **Functions** are named after the Python names, snake-cased (`UBatchSlices` ->
      `u_batch_slices`, `RUNTIME_MODES` -> `runtime_modes`); a context manager `cm` also
      gets `with_cm`. A method of a class is a function of the class's module, its first
      argument the instance, named after the class (`dp_metadata`).
    * **Files**: one module per file, under the output folder, by the module's path below
      the prefix, underscored: `MyApp.Py.MyModel.Module` with `--out lib/my_app/py` ->
      `lib/my_app/py/my_model/module.ex`, `MyApp.Py.MyModel` ->
      `lib/my_app/py/my_model.ex`. The library's output folder is `lib/vllm/`
      (`lib/vllm/forward_context/module.ex`), except for the demo's modules
      (`vllm_bridge.demo` and below): their bindings go to `demo/lib/vllm/`, which is
      compiled only in dev and test (`mix.exs`), as the rest of the demo.
    * **Manifests** (what was read of each Python module, JSON) are kept for the
      library's modules only, in `priv/bindings/` (a user's type hints that name the
      library's dataclasses and enums are resolved with them); a user's run writes no
      manifest.

  A naming is a `t:t/0`: `library/0` for the library's modules, `user/2` for a user's.
  The functions taking a naming default to the library's.
  """

  @enforce_keys [:prefix, :out]
  defstruct [:prefix, :out, package: nil, outs: [], manifests: nil]

  @typedoc """
  A naming: the Elixir `prefix`; the Python `package` that stands for the prefix itself
  (`nil`: none, every part of a module path is named); the output folder `out` and, in
  `outs`, other folders for the modules under a Python module (`{python_module, folder}`);
  the folder of the manifests (`nil`: none are written).
  """
  @type t :: %__MODULE__{
          prefix: String.t(),
          out: String.t(),
          package: String.t() | nil,
          outs: [{String.t(), String.t()}],
          manifests: String.t() | nil
        }

  @library %{
    prefix: "Vllm",
    package: "vllm_bridge",
    out: "lib/vllm",
    outs: [{"vllm_bridge.demo", "demo/lib/vllm"}],
    manifests: "priv/bindings"
  }

  @doc "The naming of the library's own modules (`vllm_bridge.x` -> `Vllm.X`)."
  @spec library() :: t()
  def library, do: struct!(__MODULE__, @library)

  @doc """
  The naming of a user's modules: `prefix` (an Elixir alias, `"MyApp.Py"`) and the output
  folder `out` (relative to the project root). Neither is checked here (the task does).
  """
  @spec user(String.t(), String.t()) :: t()
  def user(prefix, out) when is_binary(prefix) and is_binary(out),
    do: %__MODULE__{prefix: prefix, out: out}

  @doc "The Elixir module path (as a string) of a Python module."
  @spec base(String.t(), t()) :: String.t()
  def base(python_module, naming \\ library()) do
    parts = String.split(python_module, ".")

    rest =
      case {naming.package, parts} do
        {nil, parts} ->
          parts

        {package, [package | rest]} ->
          rest

        {package, _} ->
          raise ArgumentError, "#{inspect(python_module)} is not a module of #{package}"
      end

    Enum.join([naming.prefix | Enum.map(rest, &Macro.camelize/1)], ".")
  end

  @doc "The module of a Python module's functions and attributes."
  @spec functions_module(String.t(), t()) :: module()
  def functions_module(python_module, naming \\ library()),
    do: Module.concat([base(python_module, naming), "Module"])

  @doc "The module of a Python class (`module.QualName`, the class defined in `python_module`)."
  @spec class_module(String.t(), String.t(), t()) :: module()
  def class_module(python_module, class_name, naming \\ library()) do
    base = base(python_module, naming)

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
  relative to the project root: its path below the prefix, under the output folder.
  """
  @spec file(module(), String.t(), t()) :: String.t()
  def file(module, python_module, naming \\ library()) do
    prefix = String.split(naming.prefix, ".")
    parts = Module.split(module)
    {head, below} = Enum.split(parts, length(prefix))

    if head != prefix or below == [] do
      raise ArgumentError, "#{inspect(module)} is not a module below #{naming.prefix}"
    end

    Path.join(out(python_module, naming), Macro.underscore(Enum.join(below, ".")) <> ".ex")
  end

  @doc "The output folder of the bindings of `python_module`."
  @spec out(String.t(), t()) :: String.t()
  def out(python_module, naming \\ library()) do
    Enum.find_value(naming.outs, naming.out, fn {under, folder} ->
      if python_module == under or String.starts_with?(python_module, under <> "."),
        do: folder
    end)
  end

  @doc "Every output folder of a naming (see `out/2`)."
  @spec outs(t()) :: [String.t()]
  def outs(naming \\ library()), do: [naming.out | Enum.map(naming.outs, &elem(&1, 1))]

  @doc """
  The source folder (the one `mix.exs` compiles) of the library's bindings of
  `python_module`: `lib`, or `demo/lib` for the demo's.
  """
  @spec code_root(String.t()) :: String.t()
  def code_root(python_module), do: Path.dirname(out(python_module, library()))

  @doc "The manifest file of a Python module, relative to the project root (`nil`: none)."
  @spec manifest_file(String.t(), t()) :: String.t() | nil
  def manifest_file(python_module, naming \\ library())
  def manifest_file(_python_module, %__MODULE__{manifests: nil}), do: nil

  def manifest_file(python_module, %__MODULE__{manifests: dir}),
    do: Path.join(dir, python_module <> ".json")

  defp split_underscores(name) do
    rest = String.trim_leading(name, "_")
    {String.duplicate("_", byte_size(name) - byte_size(rest)), rest}
  end
end
