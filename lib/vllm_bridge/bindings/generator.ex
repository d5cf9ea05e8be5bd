defmodule VllmBridge.Bindings.Generator do
  @moduledoc false
  # Generates the bindings (`mix vllm.gen.bindings`): reads each Python module through a
  # worker (`vllm_bridge.bridge.introspect.describe_module`), writes what it read as a manifest,
  # `priv/bindings/<python module>.json` (`VllmBridge.Bindings.Json`), and the Elixir code
  # under `lib/vllm/` (the demo's under `demo/lib/vllm/`, see `VllmBridge.Bindings.Naming`)
  # from those manifests.
  #
  # The worker runs in a pool of its own whose allow-list is `vllm_bridge.bridge.introspect` alone
  # (that module imports only modules of `vllm_bridge.PUBLIC_MODULES`, and returns plain
  # data, so the worker needs no other module).
  #
  # **What is bound of a module is what it exports**: the names of its `__all__` (a module
  # without `__all__`: the public names it defines itself, not those it imports), plus the
  # names listed here beside it. Private helpers and imported names it does not export are
  # not bound. The Python modules bound, and the names added to their exports:
  #
  # | module | also bound |
  # |---|---|
  # | `vllm_bridge.forward_context` | `_compute_sp_num_tokens`, `_compute_chunked_local_num_tokens`, `_forward_context`, `logger`: vLLM's bindings have them (seeds/elixir_bindings_forward_context.txt) |
  # | `vllm_bridge.config` | |
  # | `vllm_bridge.cudagraph` | |
  # | `vllm_bridge.ubatch` | |
  # | `vllm_bridge.dp` | |
  # | `vllm_bridge.demo.rank` | (the demo's per-rank entry points) |

  alias VllmBridge.Bindings.{Json, Naming}
  alias VllmBridge.Bindings.Gen.{Files, Model}
  alias VllmBridge.Error

  @seed_names ~w(_compute_sp_num_tokens _compute_chunked_local_num_tokens _forward_context logger)

  @modules [
    {"vllm_bridge.forward_context", @seed_names},
    {"vllm_bridge.config", []},
    {"vllm_bridge.cudagraph", []},
    {"vllm_bridge.ubatch", []},
    {"vllm_bridge.dp", []},
    {"vllm_bridge.demo.rank", []}
  ]

  @pool :vllm_bindings_gen
  @format 1

  @doc "The Python modules bound, each with the names bound beyond its exports."
  @spec modules() :: [{String.t(), [String.t()]}]
  def modules, do: @modules

  @doc """
  Reads the manifests of `modules` through a worker of a pool started for the purpose (and
  stopped after). Returns them in the order of `modules`.
  """
  @spec fetch([{String.t(), [String.t()]}]) :: {:ok, [map()]} | {:error, Error.t()}
  def fetch(modules \\ @modules) do
    with {:ok, _} <-
           VllmBridge.start_pool(@pool, size: 1, allow: ["vllm_bridge.bridge.introspect"]) do
      try do
        Enum.reduce_while(modules, {:ok, []}, fn {name, also}, {:ok, acc} ->
          target = {"vllm_bridge.bridge.introspect", "describe_module"}

          case VllmBridge.call(target, [name, also], %{}, pool_name: @pool) do
            {:ok, %{"format" => @format} = manifest} ->
              {:cont, {:ok, [manifest | acc]}}

            {:ok, other} ->
              {:halt,
               {:error,
                Error.new(:protocol, "#{name}: unexpected manifest #{inspect(other, limit: 5)}")}}

            {:error, e} ->
              {:halt, {:error, e}}
          end
        end)
        |> case do
          {:ok, acc} -> {:ok, Enum.reverse(acc)}
          error -> error
        end
      after
        VllmBridge.stop_pool(@pool)
      end
    end
  end

  @doc """
  Every generated file, `%{relative path => content}`: the manifests' JSON and the Elixir
  code rendered from that JSON (decoded again, so the code follows the committed text).
  """
  @spec render([map()]) :: %{String.t() => String.t()}
  def render(manifests) do
    texts = Map.new(manifests, &{Naming.manifest_file(&1["module"]), Json.encode!(&1)})

    decoded =
      Enum.map(manifests, &Json.decode!(Map.fetch!(texts, Naming.manifest_file(&1["module"]))))

    classes = Model.classes(decoded)
    code = Enum.flat_map(decoded, &Files.render(&1, classes))
    Map.merge(texts, Map.new(code))
  end

  @doc "Reads the committed manifests of `modules` from `root` (for a run without Python)."
  @spec read_manifests(String.t(), [{String.t(), [String.t()]}]) :: [map()]
  def read_manifests(root, modules \\ @modules) do
    for {name, _} <- modules,
        do: Json.decode!(File.read!(Path.join(root, Naming.manifest_file(name))))
  end

  @doc """
  How the files under `root` differ from `files`: `{changed_or_missing, stale}`, where
  `stale` are generated files (manifests under `priv/bindings/`, and files under `lib/vllm/`
  or `demo/lib/vllm/` starting with the generator's marker) that `files` no longer has.
  """
  @spec diff(%{String.t() => String.t()}, String.t()) :: {[String.t()], [String.t()]}
  def diff(files, root) do
    changed =
      for {path, content} <- Enum.sort(files),
          File.read(Path.join(root, path)) != {:ok, content},
          do: path

    {changed, stale(files, root)}
  end

  @doc """
  Writes `files` under `root` and deletes the stale ones; returns the paths written.
  `diff` is `diff(files, root)` when the caller has it already (it reads every file).
  """
  @spec write(%{String.t() => String.t()}, String.t(), {[String.t()], [String.t()]} | nil) ::
          [String.t()]
  def write(files, root, diff \\ nil) do
    {changed, stale} = diff || diff(files, root)
    Enum.each(stale, &File.rm!(Path.join(root, &1)))

    for path <- changed do
      full = Path.join(root, path)
      File.mkdir_p!(Path.dirname(full))
      File.write!(full, Map.fetch!(files, path))
      path
    end
  end

  defp stale(files, root) do
    manifests = Path.wildcard(Path.join(root, "priv/bindings/*.json"))

    generated =
      Naming.code_roots()
      |> Enum.flat_map(&Path.wildcard(Path.join([root, &1, "vllm/**/*.ex"])))
      |> Enum.filter(&String.starts_with?(File.read!(&1), Files.marker()))

    (manifests ++ generated)
    |> Enum.map(&Path.relative_to(&1, root))
    |> Enum.reject(&Map.has_key?(files, &1))
    |> Enum.sort()
  end
end
