defmodule Mix.Tasks.Vllm.Gen.Bindings do
  @shortdoc "Generates typed Elixir bindings of Python modules (the library's, or your own)"
  @moduledoc """
  Generates typed Elixir bindings of Python modules: reads each module through a Python
  worker (`vllm_bridge.bridge.introspect`) and writes one Elixir module per Python module,
  dataclass and enum, then deletes the generated files it no longer produces.

  ## Binding your own Python modules (in your app)

      mix vllm.gen.bindings --module my_model --prefix MyApp.Py --out lib/my_app/py
      mix vllm.gen.bindings --module my_model --module pkg.sub --prefix MyApp.Py \\
        --out lib/my_app/py --python .venv/bin/python --python-path priv/python
      mix vllm.gen.bindings ... --check      # fail when the committed files are stale

  Options:

    * `--module NAME` (repeats) - a Python module to bind (dotted, `pkg.sub`). Only the
      named modules are bound, never the library's (`vllm_bridge.*` is refused: the
      library ships its bindings, `Vllm.*`).
    * `--prefix ALIAS` - the Elixir namespace of the bindings (`MyApp.Py`).
    * `--out DIR` - the folder, relative to the project root, the files go under
      (`lib/my_app/py`). **The folder belongs to the task**: a file there that starts with
      the generator's marker line and is not produced by this run is deleted, so name
      every module bound into one folder in each run (a `mix` alias is a good home for
      the command). No file elsewhere, and no file without the marker, is ever touched.
      No symbolic link is followed out of the project: a linked folder under `--out` is
      not entered, a linked file is neither deleted nor written through (a generated
      file whose path is a link, or lies in a folder that links outside, is an error),
      and an `--out` whose real path is outside the project is refused.
    * `--python PATH` - the interpreter (its environment must have the `vllm_bridge`
      package); default: `config :vllm_bridge, :python`, else `VLLM_BRIDGE_PYTHON`.
    * `--python-path DIR` (repeats) - a folder put in front of the worker's `PYTHONPATH`,
      where your modules are found (`priv/python`); the pool option `python_path:`.
    * `--check` - write nothing; fail, naming the files, when the files under `--out` are
      not what the task would write now (it reads the Python modules again).

  **Naming rule** (`VllmBridge.Bindings.Naming`): the module `my_model` becomes the base
  `MyApp.Py.MyModel`: its functions and attributes are in `MyApp.Py.MyModel.Module`, its
  dataclass `Cfg` is the struct `MyApp.Py.MyModel.Cfg`, an enum `Kind` is the type of atoms
  `MyApp.Py.MyModel.Kind`, and a class named after the module itself (`MyModel`) is the
  base `MyApp.Py.MyModel`. A dotted module `pkg.sub` becomes `MyApp.Py.Pkg.Sub`. Files go
  under `--out` by the module path below the prefix:
  `lib/my_app/py/my_model/module.ex`, `lib/my_app/py/my_model/cfg.ex`.

  The bindings follow the conventions of the library's `Vllm.*`: docs from docstrings,
  specs from type hints, structs for dataclasses (passed by value both ways: the
  application registers the structs of every app that depends on `:vllm_bridge`), atoms
  for enums, a `with_` form for each context manager, required parameters positional,
  optional ones positional or in the trailing keyword list with `__runtime__:` options.
  A type hint naming one of the library's dataclasses or enums
  (`vllm_bridge.forward_context.BatchDescriptor`) is the library's module
  (`Vllm.ForwardContext.BatchDescriptor.t()`).

  What your app gets is the generated `.ex` files alone: they need only the library at
  run time, and the task keeps nothing else in your project (no manifest). Calling them
  needs a pool whose allow-list has your modules (`modules: ["my_model"]`) and whose
  `python_path:` finds them.

  **What is bound of a module is what it exports**: the names of its `__all__` (a module
  without `__all__`: the public names it defines itself, not those it imports). Private
  helpers and imported names a module does not export are not bound.

  ## The library's own bindings (in the library)

      mix vllm.gen.bindings                  # regenerate (needs the Python venv)
      mix vllm.gen.bindings --check          # fail when the committed files are stale
      mix vllm.gen.bindings --from-manifests # re-render the code from priv/bindings/ only

  Without `--module`, inside the library, the task runs the library's preset of the same
  code: the modules `vllm_bridge.forward_context`, `.config`, `.cudagraph`, `.ubatch`,
  `.dp`, and the demo's `vllm_bridge.demo.rank`; prefix `Vllm` for the package
  `vllm_bridge` (`vllm_bridge.forward_context` -> `Vllm.ForwardContext`); files under
  `lib/vllm/` (the demo's under `demo/lib/vllm/`); the manifests `priv/bindings/*.json`.
  `vllm_bridge.forward_context` also binds the names vLLM's own bindings have beyond its
  exports (`_compute_sp_num_tokens`, `_compute_chunked_local_num_tokens`,
  `_forward_context`, `logger`; seeds/elixir_bindings_forward_context.txt). In any other
  app a run without `--module` is an error.

  ## Compilation and config

  In your app the task compiles the dependencies but not the app itself, so an app whose
  code calls bindings that do not exist yet (a first run, a Python function renamed)
  can still regenerate them. It reads your app's config of the current `MIX_ENV`: the
  file of `:config_path` (`config/config.exs` and what it imports, loaded by Mix itself
  before any task) and then `config/runtime.exs` beside it when it exists and `--python`
  is not given (evaluated as `mix run` would, for `Mix.env()` and `Mix.target()`; a
  `runtime.exs` that needs what only a running host has, a secret's variable, or the
  app's own functions, fails the task, saying so: pass `--python`). What it uses is
  `config :vllm_bridge`: the interpreter (`python:`) when `--python` is not given (then
  the variable `VLLM_BRIDGE_PYTHON`), and the call defaults (`runtime:`, a `timeout:`
  say) of its calls to its worker. It starts none of the pools your config declares
  (`config :vllm_bridge, pools: ...`), only its own one-worker pool, which imports the
  modules bound and is stopped when the task ends; it starts none of your app's processes
  either (your app is not started, nor compiled).

  In the library the project is compiled first (`app.config`): if a generated file does
  not compile any more, delete its folder (`lib/vllm/`) and run the task again.
  """
  use Mix.Task

  alias VllmBridge.Bindings.{Generator, Naming, Options}

  @impl true
  @doc false
  def run(argv) do
    opts =
      case Options.parse(argv, Mix.Project.config()[:app]) do
        {:ok, opts} -> opts
        {:error, message} -> Mix.raise(message)
      end

    root = File.cwd!()
    load_config(opts.run)
    # The task's own introspection pool is all it needs: the app's configured pools (which
    # may load the very modules being bound, with an on_start) are not started.
    Application.put_env(:vllm_bridge, :pools, [])
    {:ok, _} = Application.ensure_all_started(:vllm_bridge)
    run = opts.run

    manifests =
      cond do
        opts.from_manifests ->
          Generator.read_manifests(root, run.modules)

        true ->
          with :ok <- Options.check_python(run.pool),
               {:ok, manifests} <- Generator.fetch(run) do
            manifests
          else
            {:error, message} when is_binary(message) -> Mix.raise(message)
            {:error, e} -> Mix.raise(Options.explain(e, run))
          end
      end

    files = Generator.render(manifests, run.naming)
    diff = Generator.diff(files, root, run.naming)

    case Generator.unwritable(elem(diff, 0), root) do
      [] -> :ok
      problems -> Mix.raise("cannot write the bindings: " <> Enum.join(problems, "; "))
    end

    if opts.check, do: check(files, diff, run.naming), else: write(files, root, diff)
  end

  # The library's run compiles the library (the project) and configures it (`app.config`).
  # A user's run compiles the dependencies alone, not the app: the app's code calls the
  # bindings being generated, so it may not compile until they are (a first run, a Python
  # function renamed). Its config/config.exs is already loaded (Mix loads it before any
  # task); its config/runtime.exs is read here, as `app.config` would, but without that
  # task's check that every configured app is available: the app itself is not (it is not
  # compiled), so the check could only warn, wrongly, that it does not exist.
  defp load_config(run) do
    if run.naming == Naming.library() do
      Mix.Task.run("app.config")
    else
      Mix.Task.run("deps.loadpaths")
      runtime = Path.join(Path.dirname(Mix.Project.config()[:config_path]), "runtime.exs")
      # With --python, runtime.exs could only give call defaults: not worth a file that
      # may need the host's secrets or the (uncompiled) app's own functions.
      if File.regular?(runtime) and run.pool[:python] == nil, do: read_runtime(runtime)
    end
  end

  defp read_runtime(runtime) do
    runtime
    |> Config.Reader.read!(env: Mix.env(), target: Mix.target(), imports: :disabled)
    |> Application.put_all_env(persistent: true)
  rescue
    e ->
      Mix.raise(
        "reading #{Path.relative_to_cwd(runtime)} failed (the task reads it for " <>
          "`config :vllm_bridge, python: ...`): #{Exception.format_banner(:error, e)}; " <>
          "name the interpreter with --python, which skips that file"
      )
  end

  defp check(files, {[], []}, _naming),
    do: Mix.shell().info("bindings are up to date (#{count(map_size(files), "file")})")

  defp check(_files, {changed, stale}, naming) do
    Mix.raise(
      "the generated bindings are stale: " <>
        Enum.join(
          Enum.map(changed, &"#{&1} (differs)") ++ Enum.map(stale, &"#{&1} (stale)"),
          ", "
        ) <> "; run `mix vllm.gen.bindings#{rerun(naming)}`"
    )
  end

  defp rerun(naming) do
    if naming == Naming.library(), do: "", else: " --module ... --prefix #{naming.prefix} ..."
  end

  defp write(files, root, {_, stale} = diff) do
    written = Generator.write(files, root, diff)
    Enum.each(written, &Mix.shell().info("wrote #{&1}"))
    Enum.each(stale, &Mix.shell().info("deleted #{&1}"))

    Mix.shell().info(
      "#{length(written)} written, #{length(stale)} deleted, #{map_size(files)} generated"
    )
  end

  defp count(1, noun), do: "1 #{noun}"
  defp count(n, noun), do: "#{n} #{noun}s"
end
