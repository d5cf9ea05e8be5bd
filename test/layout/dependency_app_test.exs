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

  @runtime_exs """
  import Config

  config :vllm_bridge,
    pools: [
      own: [size: 1, python_path: [{:vb_dep_app, "priv/python"}], modules: ["vb_own_mod"]]
    ]
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
    File.write!(Path.join(dir, "config/runtime.exs"), @runtime_exs)
    File.cp!(@own_module, Path.join(dir, "priv/python/vb_own_mod.py"))
    on_exit(fn -> File.rm_rf!(dir) end)
    %{dir: dir}
  end

  defp mix!(dir, args) do
    env = [
      {"MIX_ENV", "prod"},
      {"VLLM_BRIDGE_PYTHON", Application.fetch_env!(:vllm_bridge, :python)}
    ]

    {out, status} = System.cmd("mix", args, cd: dir, env: env, stderr_to_stdout: true)
    assert status == 0, "mix #{Enum.join(args, " ")} failed (#{status}):\n#{out}"
    out
  end

  @tag timeout: 300_000
  test "a fresh app binds its own module, compiles and calls it", %{dir: dir} do
    out = mix!(dir, @gen)
    assert out =~ "wrote lib/vb_dep_app/py/vb_own_mod/module.ex"
    generated = File.read!(Path.join(dir, "lib/vb_dep_app/py/vb_own_mod/module.ex"))
    assert generated =~ "defmodule VbDepApp.Py.VbOwnMod.Module do"
    # Only the named module's files: none of the library's own bindings.
    assert Path.wildcard(Path.join(dir, "lib/**/*.ex")) |> length() == 2
    refute File.exists?(Path.join(dir, "lib/vllm"))

    assert mix!(dir, @gen ++ ["--check"]) =~ "bindings are up to date (1 files)"
    mix!(dir, ["compile", "--warnings-as-errors"])
    assert mix!(dir, ["run", "-e", "IO.inspect(VbDepApp.hello())"]) =~ ~s({:ok, "own module"})
  end
end
