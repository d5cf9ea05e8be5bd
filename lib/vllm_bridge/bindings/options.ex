defmodule VllmBridge.Bindings.Options do
  @moduledoc false
  # The command line of `mix vllm.gen.bindings`, checked before anything starts: each bad
  # value is refused with a message naming it. The result is a run of
  # `VllmBridge.Bindings.Generator` (the library's preset, or a user's modules) and the
  # task's own switches.

  alias VllmBridge.Bindings.Generator
  alias VllmBridge.Bindings.Gen.Tree
  alias VllmBridge.Error

  @switches [
    check: :boolean,
    from_manifests: :boolean,
    module: :keep,
    prefix: :string,
    out: :string,
    python: :string,
    python_path: :keep
  ]

  @usage "mix vllm.gen.bindings --module my_model --prefix MyApp.Py --out lib/my_app/py"
  @package "vllm_bridge"
  @module_name ~r/\A[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\z/
  @alias_name ~r/\A[A-Z][A-Za-z0-9_]*(\.[A-Z][A-Za-z0-9_]*)*\z/
  # Namespaces a user's bindings may not take: the library's own.
  @taken ~w(Vllm VllmBridge Elixir)

  @typedoc "What the task does."
  @type t :: %{run: Generator.run(), check: boolean(), from_manifests: boolean()}

  @doc """
  Parses and checks `argv` of a run in the project of the OTP app `app` (the library's
  preset runs only in `:vllm_bridge` itself). Paths are relative to the current folder.
  """
  @spec parse([String.t()], atom()) :: {:ok, t()} | {:error, String.t()}
  def parse(argv, app) do
    case OptionParser.parse(argv, strict: @switches) do
      {opts, [], []} ->
        checked(opts, app)

      {_, _, [{name, nil} | _]} ->
        {:error, "unknown option #{name} (see `mix help vllm.gen.bindings`)"}

      {_, _, [{name, value} | _]} ->
        {:error, "invalid value #{inspect(value)} for #{name}"}

      {_, rest, []} ->
        {:error, "unexpected arguments: #{Enum.join(rest, " ")} (options start with --)"}
    end
  end

  defp checked(opts, app) do
    modules = opts |> Keyword.get_values(:module) |> Enum.uniq()

    with {:ok, pool} <- pool(opts) do
      base = %{check: opts[:check] == true, from_manifests: opts[:from_manifests] == true}

      if modules == [],
        do: library(opts, app, pool, base),
        else: user(modules, opts, pool, base)
    end
  end

  defp library(opts, app, pool, base) do
    cond do
      app != :vllm_bridge ->
        {:error,
         "name the Python modules to bind: #{@usage} (a run without --module regenerates " <>
           "the vllm_bridge library's own bindings, and only inside the library)"}

      given = Enum.find([:prefix, :out, :python_path], &Keyword.has_key?(opts, &1)) ->
        {:error, "--#{dashed(given)} goes with --module (#{@usage})"}

      true ->
        {:ok, Map.put(base, :run, Generator.library(pool))}
    end
  end

  defp user(modules, opts, pool, base) do
    with :ok <- no_manifests(base),
         :ok <- each(modules, &module_name/1),
         {:ok, prefix} <- prefix(opts[:prefix]),
         {:ok, out} <- out(opts[:out]) do
      {:ok, Map.put(base, :run, Generator.user(modules, prefix, out, pool))}
    end
  end

  defp no_manifests(%{from_manifests: true}),
    do:
      {:error,
       "--from-manifests is for the library's own bindings: a run with --module keeps no manifests"}

  defp no_manifests(_), do: :ok

  defp module_name(name) do
    cond do
      not Regex.match?(@module_name, name) ->
        {:error, "--module #{inspect(name)} is not a dotted Python module name (pkg.sub)"}

      name == @package or String.starts_with?(name, @package <> ".") ->
        {:error,
         "--module #{name} is a module of the vllm_bridge library, whose bindings it ships " <>
           "(Vllm.*); name your own Python modules"}

      true ->
        :ok
    end
  end

  defp prefix(nil),
    do:
      {:error,
       "--prefix is required with --module: the Elixir namespace of the bindings (#{@usage})"}

  defp prefix(prefix) do
    cond do
      not Regex.match?(@alias_name, prefix) ->
        {:error, "--prefix #{inspect(prefix)} is not an Elixir alias (such as MyApp.Py)"}

      (first = prefix |> String.split(".") |> hd()) in @taken ->
        {:error,
         "--prefix #{prefix}: the namespace #{first} is the library's or Elixir's; use your app's (MyApp.Py)"}

      true ->
        {:ok, prefix}
    end
  end

  defp out(nil),
    do: {:error, "--out is required with --module: the folder the bindings go under (#{@usage})"}

  defp out(out) do
    root = File.cwd!()
    full = Path.expand(out, root)

    cond do
      out == "" or String.contains?(out, <<0>>) ->
        {:error, "--out #{inspect(out)} is not a folder path"}

      Path.type(out) != :relative or ".." in Path.split(out) or full == root ->
        {:error,
         "--out #{inspect(out)} must be a folder inside the project, relative to its root " <>
           "(such as lib/my_app/py)"}

      Path.extname(out) in [".ex", ".exs"] or File.regular?(full) ->
        {:error, "--out #{inspect(out)} names a file, not a folder"}

      true ->
        linked(out, Path.relative_to(full, root), root)
    end
  end

  # The folder's real path (symbolic links resolved, its own and its parents') must be
  # inside the project too: the task deletes files there.
  defp linked(out, relative, root) do
    case Tree.folder(root, relative) do
      {:ok, _real} ->
        {:ok, relative}

      {:error, :root} ->
        {:error,
         "--out #{inspect(out)} must be a folder inside the project, not its root (it is " <>
           "a symbolic link to the root)"}

      {:error, {:outside, real}} ->
        {:error,
         "--out #{inspect(out)} leads outside the project (to #{real}) through a symbolic " <>
           "link; name a folder inside the project"}

      {:error, {:loop, link}} ->
        {:error, "--out #{inspect(out)}: a loop of symbolic links at #{link}"}
    end
  end

  defp pool(opts) do
    dirs = Keyword.get_values(opts, :python_path)

    case Enum.find(dirs, &(not File.dir?(&1))) do
      nil ->
        pool = if dirs == [], do: [], else: [python_path: Enum.map(dirs, &Path.expand/1)]
        {:ok, if(opts[:python], do: [python: opts[:python]] ++ pool, else: pool)}

      dir ->
        {:error, "--python-path #{inspect(dir)} is not a folder"}
    end
  end

  @doc """
  Checks that the interpreter of a run's pool exists and has the `vllm_bridge` package,
  without importing it (a fraction of a second), so that the task can say so plainly.
  """
  @spec check_python(keyword()) :: :ok | {:error, String.t()}
  def check_python(pool) do
    case VllmBridge.Pool.Options.resolve_python(pool[:python]) do
      nil ->
        {:error,
         "no Python interpreter: pass --python PATH, set `config :vllm_bridge, python: ...`, " <>
           "or set the environment variable VLLM_BRIDGE_PYTHON; its environment must have " <>
           "the vllm_bridge package (docs/USING.md)"}

      python ->
        probe =
          "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm_bridge') else 3)"

        try do
          case System.cmd(python, ["-c", probe], stderr_to_stdout: true) do
            {_, 0} ->
              :ok

            {_, 3} ->
              {:error,
               "the Python #{python} has no vllm_bridge package: install it into that " <>
                 "environment (pip install <the vllm_bridge dependency's folder>; docs/USING.md), " <>
                 "or name another interpreter with --python"}

            {output, status} ->
              {:error,
               "the Python #{python} failed (exit status #{status}): #{String.trim(output)}"}
          end
        rescue
          e in ErlangError ->
            {:error, "the Python #{python} cannot be run: #{inspect(e.original)}"}
        end
    end
  end

  @doc "The task's message for an error of `Generator.fetch/1` in a run."
  @spec explain(Error.t(), Generator.run()) :: String.t()
  def explain(%Error{details: %{module: module}, python_type: type} = e, run)
      when is_binary(type) do
    "reading the Python module #{module} failed: #{type}: #{e.message}#{hint(e.message, run)}"
  end

  def explain(%Error{details: %{module: module}} = e, _run),
    do: "reading the Python module #{module} failed: #{Exception.message(e)}"

  # The pool refuses to start when a module of its allow-list fails to import; its message
  # names each module with its error's type and message.
  def explain(e, run) do
    message = Exception.message(e)
    "reading the Python modules failed: #{message}#{hint(message, run)}"
  end

  # Where a bound module itself (or its package) is not found, its folder is likely missing
  # from --python-path; a module it imports (torch, say) is missing from the environment.
  defp hint(message, run) do
    missing =
      case Regex.run(~r/No module named '([^']+)'/, message) do
        [_, name] -> name
        nil -> nil
      end

    bound? =
      missing != nil and
        Enum.any?(run.modules, fn {name, _} ->
          name == missing or String.starts_with?(name, missing <> ".")
        end)

    cond do
      bound? ->
        "; is its folder given with --python-path (and its name spelt right)?"

      missing != nil ->
        "; #{missing} is missing from the interpreter's environment (pip install it there)"

      true ->
        ""
    end
  end

  defp each(items, fun) do
    Enum.reduce_while(items, :ok, fn item, :ok ->
      case fun.(item) do
        :ok -> {:cont, :ok}
        error -> {:halt, error}
      end
    end)
  end

  defp dashed(key), do: key |> Atom.to_string() |> String.replace("_", "-")
end
