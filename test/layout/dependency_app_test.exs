defmodule VllmBridge.Layout.DependencyAppTest do
  @moduledoc """
  The library as a user's app has it: a fresh mix project with a path dependency on this
  repository (built in `:prod`, as a dependency is), its own Python module in
  `priv/python`, and code that already calls the bindings of that module before they
  exist. In that project, run as separate `mix` commands: the bindings task generates the
  bindings (the app's code not compiling yet must not stop it), `--check` passes, the app
  then compiles with warnings as errors, and a pool from its `config/runtime.exs` calls
  the module through the generated binding. docs/USING.md describes this path; the example
  app (examples/tiny_model) is the complete one.
  """
  use ExUnit.Case, async: false

  @root Path.expand("../..", __DIR__)
  @own_module Path.expand("../support/own_modules/vb_own_mod.py", __DIR__)

  @mix_exs """
  defmodule VbDepApp.MixProject do
    use Mix.Project

    def project do
      [
        app: :vb_dep_app,
        version: "0.1.0",
        elixir: "~> 1.14",
        elixirc_options: [warnings_as_errors: true],
        deps: [{:vllm_bridge, path: #{inspect(@root)}}]
      ]
    end

    def application, do: [extra_applications: [:logger]]
  end
  """

  @app_ex """
  defmodule VbDepApp do
    @moduledoc "Calls its own Python module through the generated binding."
    @spec hello() :: {:ok, String.t()} | {:error, VllmBridge.Error.t()}
    def hello, do: VbDepApp.Py.VbOwnMod.Module.whoami(__runtime__: [pool_name: :own])
  end
  """

  # The interpreter is configured in runtime.exs, from a variable named in config.exs: the
  # bindings task reads both. The app's config of itself (:vb_dep_app) is what made Mix warn
  # "the application is not available" while the app was not compiled yet.
  @config_exs """
  import Config

  config :vb_dep_app, python_env: "VB_DEP_APP_PYTHON"
  """

  @runtime_exs """
  import Config

  config :vllm_bridge,
    python: System.fetch_env!(Application.fetch_env!(:vb_dep_app, :python_env)),
    pools: [
      own: [size: 1, python_path: [{:vb_dep_app, "priv/python"}], modules: ["vb_own_mod"]]
    ]

  # A pool that cannot start: were the bindings task to start the configured pools, it
  # would fail.
  if System.get_env("VB_DEP_APP_BROKEN_POOL") do
    config :vllm_bridge, pools: [broken: [size: 1, python: "/no/such/python"]]
  end
  """

  @gen ~w(vllm.gen.bindings --module vb_own_mod --prefix VbDepApp.Py --out lib/vb_dep_app/py
          --python-path priv/python)

  setup do
    dir = Path.join(System.tmp_dir!(), "vb_dep_app_#{System.unique_integer([:positive])}")
    File.mkdir_p!(Path.join(dir, "lib"))
    File.mkdir_p!(Path.join(dir, "config"))
    File.mkdir_p!(Path.join(dir, "priv/python"))
    File.write!(Path.join(dir, "mix.exs"), @mix_exs)
    File.write!(Path.join(dir, "lib/vb_dep_app.ex"), @app_ex)
    File.write!(Path.join(dir, "config/config.exs"), @config_exs)
    File.write!(Path.join(dir, "config/runtime.exs"), @runtime_exs)
    File.cp!(@own_module, Path.join(dir, "priv/python/vb_own_mod.py"))
    on_exit(fn -> File.rm_rf!(dir) end)
    %{dir: dir}
  end

  defp mix(dir, args, env \\ []) do
    env =
      [
        {"MIX_ENV", "prod"},
        {"VLLM_BRIDGE_PYTHON", nil},
        {"VB_DEP_APP_PYTHON", Application.fetch_env!(:vllm_bridge, :python)}
      ] ++ env

    System.cmd("mix", args, cd: dir, env: env, stderr_to_stdout: true)
  end

  defp mix!(dir, args, env \\ []) do
    {out, status} = mix(dir, args, env)
    assert status == 0, "mix #{Enum.join(args, " ")} failed (#{status}):\n#{out}"
    out
  end

  @tag timeout: 300_000
  test "a fresh app binds its own module, compiles and calls it", %{dir: dir} do
    gen_env = [{"VB_DEP_APP_BROKEN_POOL", "1"}]
    out = mix!(dir, @gen, gen_env)
    refute out =~ "is not available", out
    assert out =~ "wrote lib/vb_dep_app/py/vb_own_mod/module.ex"
    generated = File.read!(Path.join(dir, "lib/vb_dep_app/py/vb_own_mod/module.ex"))
    assert generated =~ "defmodule VbDepApp.Py.VbOwnMod.Module do"
    # Only the named module's files: none of the library's own bindings.
    assert Path.wildcard(Path.join(dir, "lib/**/*.ex")) |> length() == 2
    refute File.exists?(Path.join(dir, "lib/vllm"))

    out = mix!(dir, @gen ++ ["--check"], gen_env)
    assert out =~ "bindings are up to date (1 file)\n"
    refute out =~ "is not available", out
    mix!(dir, ["compile", "--warnings-as-errors"])
    assert mix!(dir, ["run", "-e", "IO.inspect(VbDepApp.hello())"]) =~ ~s({:ok, "own module"})

    # A runtime.exs that needs what only the running host has: the task says which file
    # failed and how to do without it; with --python it does not read that file.
    File.write!(Path.join(dir, "config/runtime.exs"), """
    import Config
    config :vb_dep_app, secret: System.fetch_env!("VB_DEP_APP_NO_SUCH_SECRET")
    """)

    {out, status} = mix(dir, @gen ++ ["--check"])
    assert status != 0
    assert out =~ "reading config/runtime.exs failed"
    assert out =~ "VB_DEP_APP_NO_SUCH_SECRET"
    assert out =~ "--python"

    python = Application.fetch_env!(:vllm_bridge, :python)
    assert mix!(dir, @gen ++ ["--check", "--python", python]) =~ "up to date (1 file)"
  end
end
