defmodule VllmBridge.Bindings.Generator do
  @moduledoc false
  # Generates the bindings (`mix vllm.gen.bindings`) of a *run*: the Python modules to bind
  # and a naming (`VllmBridge.Bindings.Naming`). One code path for both kinds of run:
  #
  #   * the library's own (`library/0`, the task without `--module` inside the library):
  #     the modules below, prefix `Vllm` for the package `vllm_bridge`, code under
  #     `lib/vllm/` (the demo's under `demo/lib/vllm/`), manifests in `priv/bindings/`;
  #   * a user's (`user/4`): the named modules, the user's prefix and output folder, no
  #     manifests; type hints naming the library's dataclasses and enums resolve to the
  #     library's modules through the library's committed manifests
  #     (`Application.app_dir(:vllm_bridge, "priv/bindings")`).
  #
  # It reads each Python module through a worker
  # (`vllm_bridge.bridge.introspect.describe_module`), of a pool of its own whose
  # allow-list is the introspection module plus the modules bound (the introspection
  # module describes only modules of its worker's allow-list); renders the manifests'
  # JSON (`VllmBridge.Bindings.Json`) and the Elixir code from that JSON.
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
  alias VllmBridge.Bindings.Gen.{Files, Model, Tree}
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

  @introspect "vllm_bridge.bridge.introspect"
  @pool :vllm_bindings_gen
  @format 1

  @typedoc """
  A run: the Python modules (each with the names bound beyond its exports), the naming,
  and the options of the introspection pool (`:python`, `:python_path`).
  """
  @type run :: %{
          modules: [{String.t(), [String.t()]}],
          naming: Naming.t(),
          pool: keyword()
        }

  @doc "The Python modules of the library bound, each with the names bound beyond its exports."
  @spec modules() :: [{String.t(), [String.t()]}]
  def modules, do: @modules

  @doc "The library's own run (`pool` as in `t:run/0`)."
  @spec library(keyword()) :: run()
  def library(pool \\ []), do: %{modules: @modules, naming: Naming.library(), pool: pool}

  @doc "A user's run: `modules` (names) bound under `prefix`, written under `out`."
  @spec user([String.t()], String.t(), String.t(), keyword()) :: run()
  def user(modules, prefix, out, pool \\ []),
    do: %{modules: Enum.map(modules, &{&1, []}), naming: Naming.user(prefix, out), pool: pool}

  @doc """
  Reads the manifests of a run's modules through a worker of a pool started for the
  purpose (and stopped after). Returns them in the order of the modules. (A list of
  modules stands for the library's run of those modules.)
  """
  @spec fetch(run() | [{String.t(), [String.t()]}]) :: {:ok, [map()]} | {:error, Error.t()}
  def fetch(run \\ library())

  def fetch(modules) when is_list(modules), do: fetch(%{library() | modules: modules})

  def fetch(%{modules: modules, pool: pool}) do
    allow = [@introspect | Enum.map(modules, &elem(&1, 0))]

    with {:ok, _} <- VllmBridge.start_pool(@pool, [size: 1, allow: allow] ++ pool) do
      try do
        Enum.reduce_while(modules, {:ok, []}, fn {name, also}, {:ok, acc} ->
          case describe(name, also) do
            {:ok, manifest} -> {:cont, {:ok, [manifest | acc]}}
            error -> {:halt, error}
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

  defp describe(name, also) do
    case VllmBridge.call({@introspect, "describe_module"}, [name, also], %{}, pool_name: @pool) do
      {:ok, %{"format" => @format} = manifest} ->
        {:ok, manifest}

      {:ok, other} ->
        {:error, Error.new(:protocol, "#{name}: unexpected manifest #{inspect(other, limit: 5)}")}

      # The module's name goes with the error (the task names it).
      {:error, e} ->
        {:error, %{e | details: Map.put(e.details || %{}, :module, name)}}
    end
  end

  @doc """
  Every generated file of `manifests` named by `naming` (default: the library's),
  `%{relative path => content}`: the manifests' JSON when the naming keeps manifests, and
  the Elixir code rendered from that JSON (decoded again, so the code follows the
  committed text). A user's naming resolves the library's classes with `library_manifests/0`.
  """
  @spec render([map()], Naming.t()) :: %{String.t() => String.t()}
  def render(manifests, naming \\ Naming.library()) do
    texts = Map.new(manifests, &{&1["module"], Json.encode!(&1)})
    decoded = Enum.map(manifests, &Json.decode!(Map.fetch!(texts, &1["module"])))

    library =
      if naming == Naming.library(),
        do: %{},
        else: Model.classes(library_manifests(), Naming.library())

    classes = Map.merge(library, Model.classes(decoded, naming))
    code = Enum.flat_map(decoded, &Files.render(&1, classes, naming))

    json =
      for {module, text} <- texts,
          path = Naming.manifest_file(module, naming),
          into: %{},
          do: {path, text}

    Map.merge(json, Map.new(code))
  end

  @doc """
  The library's committed manifests of the modules it binds outside the demo, read from
  its application's `priv/bindings/` (a user's run resolves the library's classes with
  them). Raises naming the file when one cannot be read.
  """
  @spec library_manifests() :: [map()]
  def library_manifests do
    dir = Application.app_dir(:vllm_bridge, "priv/bindings")

    for {name, _} <- @modules, Naming.code_root(name) == "lib" do
      path = Path.join(dir, name <> ".json")

      case File.read(path) do
        {:ok, text} ->
          Json.decode!(text)

        {:error, why} ->
          raise "cannot read the library's manifest #{path}: #{:file.format_error(why)}"
      end
    end
  end

  @doc "Reads the committed manifests of `modules` from `root` (for a run without Python)."
  @spec read_manifests(String.t(), [{String.t(), [String.t()]}]) :: [map()]
  def read_manifests(root, modules \\ @modules) do
    for {name, _} <- modules,
        do: Json.decode!(File.read!(Path.join(root, Naming.manifest_file(name))))
  end

  @doc """
  How the files under `root` differ from `files`: `{changed_or_missing, stale}`, where
  `stale` are generated files that `files` no longer has: files under the naming's output
  folders starting with the generator's marker, and the manifests in its manifest folder.
  Nothing else is ever stale: no file reached through a symbolic link, nor a link itself,
  nor anything under an output folder whose real path is outside `root`.
  """
  @spec diff(%{String.t() => String.t()}, String.t(), Naming.t()) ::
          {[String.t()], [String.t()]}
  def diff(files, root, naming \\ Naming.library()) do
    changed =
      for {path, content} <- Enum.sort(files),
          File.read(Path.join(root, path)) != {:ok, content},
          do: path

    {changed, stale(files, root, naming)}
  end

  @doc """
  Why each of `paths` (relative to `root`) may not be written, one message per path that
  may not (none: `[]`): a file is written only when the real path of its folder is inside
  `root` and the file itself is not a symbolic link (see `VllmBridge.Bindings.Gen.Tree`).
  """
  @spec unwritable([String.t()], String.t()) :: [String.t()]
  def unwritable(paths, root), do: Enum.flat_map(paths, &List.wrap(Tree.unwritable(root, &1)))

  @doc """
  Writes `files` under `root` and deletes the stale ones of `diff` (`diff(files, root)`
  of the library's naming when `nil`); returns the paths written. Raises `ArgumentError`,
  writing and deleting nothing, when a file to write is `unwritable/2`.
  """
  @spec write(%{String.t() => String.t()}, String.t(), {[String.t()], [String.t()]} | nil) ::
          [String.t()]
  def write(files, root, diff \\ nil) do
    {changed, stale} = diff || diff(files, root)

    case unwritable(changed, root) do
      [] -> :ok
      problems -> raise ArgumentError, Enum.join(problems, "; ")
    end

    Enum.each(stale, &File.rm!(Path.join(root, &1)))

    for path <- changed do
      full = Path.join(root, path)
      File.mkdir_p!(Path.dirname(full))
      File.write!(full, Map.fetch!(files, path))
      path
    end
  end

  # The stale files: generated ones under the output folders, manifests in the manifest
  # folder, that `files` no longer has. Found without following a symbolic link (an output
  # folder itself counts only when its real path is inside `root`: `Tree.folder/2`), so
  # that nothing outside the project is ever deleted.
  defp stale(files, root, naming) do
    manifests =
      if naming.manifests,
        do: under(root, naming.manifests, ".json", recursive: false),
        else: []

    generated =
      naming
      |> Naming.outs()
      |> Enum.flat_map(&under(root, &1, ".ex"))
      |> Enum.filter(&generated?(Path.join(root, &1)))

    (manifests ++ generated)
    |> Enum.reject(&Map.has_key?(files, &1))
    |> Enum.sort()
  end

  # The files of `Tree.files/3` under the folder `dir` of `root`, relative to `root`.
  defp under(root, dir, ext, opts \\ []) do
    case Tree.folder(root, dir) do
      {:ok, real} -> Enum.map(Tree.files(real, ext, opts), &Path.join(dir, &1))
      {:error, _} -> []
    end
  end

  # Whether a file starts with the generator's marker (read no more than the marker).
  defp generated?(path) do
    marker = Files.marker()

    case File.open(path, [:read, :binary], &IO.binread(&1, byte_size(marker))) do
      {:ok, ^marker} -> true
      _ -> false
    end
  end
end
