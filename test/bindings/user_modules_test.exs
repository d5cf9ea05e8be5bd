Code.require_file("../support/bindings_helpers.exs", __DIR__)

defmodule VllmBridge.Bindings.UserModulesTest do
  @moduledoc """
  `mix vllm.gen.bindings --module ... --prefix ... --out ...` on a user's own Python
  modules (test/support/user_python: a dataclass, an enum, a context manager, keyword-only
  arguments, hints naming the library's BatchDescriptor and CUDAGraphMode), run against a
  real worker in a project folder of its own: the files it writes, that they compile, that
  they call Python through a real pool, `--check`, and the errors of bad input.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log
  @moduletag timeout: 300_000

  import VllmBridge.BindingsHelpers, only: [gen_task!: 2, gen_task_error: 2]

  alias VllmBridge.Bindings.Gen.Files
  alias VllmBridge.Codec.Registry

  @user_dir Path.expand("../support/user_python", __DIR__)
  @args ~w(--module my_model --module my_pkg.sub --prefix MyApp.Py --out lib/my_app/py) ++
          ["--python-path", @user_dir]
  @expected [
    "lib/my_app/py/my_model.ex",
    "lib/my_app/py/my_model/cfg.ex",
    "lib/my_app/py/my_model/kind.ex",
    "lib/my_app/py/my_model/module.ex",
    "lib/my_app/py/my_pkg/sub/module.ex"
  ]

  defp tmp_project! do
    dir = Path.join(System.tmp_dir!(), "vb_user_app_#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    ExUnit.Callbacks.on_exit(fn -> File.rm_rf!(dir) end)
    dir
  end

  defp files(dir) do
    dir
    |> Path.join("**/*")
    |> Path.wildcard()
    |> Enum.filter(&File.regular?/1)
    |> Enum.map(&Path.relative_to(&1, dir))
    |> Enum.sort()
  end

  # A generated module (compiled by the tests, so named at run time).
  defp py(name), do: Module.concat(["MyApp.Py", name])

  setup_all do
    dir = Path.join(System.tmp_dir!(), "vb_user_app_#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf!(dir) end)
    lines = gen_task!(dir, @args)
    paths = Enum.map(@expected, &Path.join(dir, &1))
    {:ok, modules, warnings} = Kernel.ParallelCompiler.compile(paths, return_diagnostics: true)
    %{dir: dir, lines: lines, compiled: modules, warnings: warnings}
  end

  describe "the files written" do
    test "are the named modules' only, under --out by the module path below the prefix", %{
      dir: dir,
      lines: lines
    } do
      assert files(dir) == @expected
      assert List.last(lines) == "5 written, 0 deleted, 5 generated"

      for path <- @expected do
        text = File.read!(Path.join(dir, path))
        assert String.starts_with?(text, Files.marker()), path
        # Nothing of the library's own run: no manifest named, no Vllm module defined.
        refute text =~ "priv/bindings"
        refute text =~ "defmodule Vllm."
      end
    end

    test "compile, defining the modules of the naming rule", %{
      dir: dir,
      compiled: modules,
      warnings: warnings
    } do
      assert warnings == []

      assert Enum.sort(modules) ==
               Enum.sort(
                 Enum.map(
                   ~w(MyModel MyModel.Cfg MyModel.Kind MyModel.Module MyPkg.Sub.Module),
                   &py/1
                 )
               )

      # Types from the hints: the library's classes are the library's modules.
      source = File.read!(Path.join(dir, "lib/my_app/py/my_model/module.ex"))
      assert source =~ "@spec describe_batch(Vllm.ForwardContext.BatchDescriptor.t())"
      assert source =~ "{:ok, Vllm.Cudagraph.CUDAGraphMode.t()}"
      assert source =~ "def with_scope(name, fun)"
      assert py("MyModel.Kind").__members__() == [:eager, :graph]
      assert py("MyModel.Cfg").__python_class__() == "my_model.Cfg"
      assert struct!(py("MyModel.Cfg"), width: 1).kind == :eager
      assert py("MyModel").__python_class__() == "my_model.MyModel"
    end
  end

  describe "the generated functions" do
    setup do
      pool = :user_bindings

      {:ok, _} =
        VllmBridge.start_pool(pool,
          size: 1,
          python_path: [@user_dir],
          modules: ["my_model", "my_pkg.sub"]
        )

      on_exit(fn -> VllmBridge.stop_pool(pool) end)
      :ok = VllmBridge.Pool.await_ready(pool, 60_000)
      %{rt: [__runtime__: [pool_name: pool]]}
    end

    test "call Python with positional, optional and keyword-only arguments", %{rt: rt} do
      m = py("MyModel.Module")
      assert m.scaled(1.5, "a", rt) == {:ok, %{"value" => 3.0, "label" => "a"}}

      assert m.scaled(1.5, "a", 3.0, [offset: 1.0] ++ rt) ==
               {:ok, %{"value" => 5.5, "label" => "a"}}

      assert {:error, %VllmBridge.Error{type: :bad_argument, message: msg}} =
               m.scaled("x", "a", rt)

      assert msg =~ "x"
      assert py("MyPkg.Sub.Module").ping(41, rt) == {:ok, 42}
      assert m.version(rt) == {:ok, "1.0"}
    end

    test "take and return the library's dataclass and enum as the library's modules", %{rt: rt} do
      m = py("MyModel.Module")
      empty = %Vllm.ForwardContext.BatchDescriptor{num_tokens: 0}
      assert m.describe_batch(empty, rt) == {:ok, :none}
      assert m.describe_batch(%{empty | num_tokens: 8}, rt) == {:ok, :full}
      assert m.describe_batch(empty, [mode: :piecewise] ++ rt) == {:ok, :piecewise}
      assert {:error, %VllmBridge.Error{type: :bad_argument}} = m.describe_batch(%{}, rt)
    end

    test "enter and exit a context manager with the with_ form", _context do
      m = py("MyModel.Module")
      {:ok, session} = VllmBridge.Session.open(pool_name: :user_bindings)
      rt = [__runtime__: [pool_name: :user_bindings, session_id: session]]
      on_exit(fn -> VllmBridge.Session.close(session) end)

      assert {:ok, {1, {:ok, 2}}} =
               m.with_scope("outer", rt, fn depth ->
                 {depth, m.with_scope("inner", rt, fn inner -> inner end)}
               end)
    end

    test "a user's dataclass comes back as the user's struct once its app is registered", %{
      rt: rt
    } do
      m = py("MyModel.Module")
      cfg = py("MyModel.Cfg")
      # Not registered yet (the modules belong to no app): a generic object.
      assert {:ok, %VllmBridge.Object{class: "my_model.Cfg"}} = m.make_cfg(3, rt)

      # An app depending on :vllm_bridge that holds the generated modules, and one that
      # does not depend on it: what the application does at start registers the first only.
      {:module, other, _, _} =
        Module.create(
          Module.concat(__MODULE__, OtherStruct),
          quote do
            defstruct [:a]
            def __python_class__, do: "other_app.Thing"
            def __python_fields__, do: [:a]
          end,
          Macro.Env.location(__ENV__)
        )

      load_app(:vb_user_app, [cfg, py("MyModel"), py("MyModel.Kind")], [:vllm_bridge])
      load_app(:vb_unrelated_app, [other], [])
      assert Registry.load_dependents() >= 2

      assert m.make_cfg(3, rt) == {:ok, struct!(cfg, width: 3, kind: :graph, tags: ["made"])}

      assert m.make_cfg(4, :eager, rt) ==
               {:ok, struct!(cfg, width: 4, kind: :eager, tags: ["made"])}

      assert Registry.registered()["my_model.Cfg"] == cfg
      refute Map.has_key?(Registry.registered(), "other_app.Thing")
      # A struct goes to Python by value, and its method is bound on its module.
      assert cfg.doubled(struct!(cfg, width: 5), rt) == {:ok, 10}
    end
  end

  defp load_app(app, modules, deps) do
    spec = [description: ~c"test app", vsn: ~c"0.1.0", modules: modules, registered: []]
    spec = Keyword.put(spec, :applications, [:kernel, :stdlib | deps])
    :ok = :application.load({:application, app, spec})
    on_exit(fn -> :application.unload(app) end)
  end

  describe "--check" do
    test "passes on fresh files and fails naming a changed and a stale file" do
      dir = tmp_project!()
      gen_task!(dir, @args)

      assert List.last(gen_task!(dir, @args ++ ["--check"])) ==
               "bindings are up to date (5 files)"

      File.write!(Path.join(dir, "lib/my_app/py/my_model/kind.ex"), "# edited\n", [:append])
      stale = "lib/my_app/py/old/module.ex"
      File.mkdir_p!(Path.join(dir, "lib/my_app/py/old"))
      File.write!(Path.join(dir, stale), Files.marker() <> " from the Python module old.\n")
      message = gen_task_error(dir, @args ++ ["--check"])
      assert message =~ "lib/my_app/py/my_model/kind.ex (differs)"
      assert message =~ "#{stale} (stale)"
    end

    test "a run deletes only marker files under --out" do
      dir = tmp_project!()
      stale = "lib/my_app/py/old.ex"
      hand = "lib/my_app/py/hand.ex"
      outside = "lib/other/gen.ex"

      for {path, text} <- [
            {stale, Files.marker() <> " from x\n"},
            {hand, "defmodule Hand do\nend\n"},
            {outside, Files.marker() <> " from x\n"}
          ] do
        File.mkdir_p!(Path.dirname(Path.join(dir, path)))
        File.write!(Path.join(dir, path), text)
      end

      lines = gen_task!(dir, @args)
      assert "deleted #{stale}" in lines
      refute File.exists?(Path.join(dir, stale))
      assert File.exists?(Path.join(dir, hand))
      assert File.exists?(Path.join(dir, outside))
    end
  end

  describe "bad input is refused, naming the value" do
    setup do
      %{dir: tmp_project!()}
    end

    test "an unknown module, and one that fails to import", %{dir: dir} do
      base = ~w(--prefix MyApp.Py --out lib/py --python-path) ++ [@user_dir]

      assert gen_task_error(dir, ["--module", "no_such_user_mod" | base]) =~
               "no_such_user_mod (ModuleNotFoundError: No module named 'no_such_user_mod'); " <>
                 "fix the module"

      assert gen_task_error(dir, ["--module", "my_broken" | base]) =~
               "my_broken (RuntimeError: my_broken fails on purpose)"

      assert files(dir) == []
    end

    test "the command line", %{dir: dir} do
      File.write!(Path.join(dir, "afile"), "")
      ok = ~w(--module my_model --prefix MyApp.Py --out lib/py)

      cases = [
        {~w(--module my_model --prefix myApp.py --out lib/py),
         ~s(--prefix "myApp.py" is not an Elixir alias)},
        {~w(--module my_model --prefix MyApp. --out lib/py),
         ~s(--prefix "MyApp." is not an Elixir alias)},
        {~w(--module my_model --prefix My-App --out lib/py),
         ~s(--prefix "My-App" is not an Elixir alias)},
        {~w(--module my_model --prefix Vllm.Mine --out lib/py), "the namespace Vllm"},
        {~w(--module my_model --out lib/py), "--prefix is required"},
        {~w(--module my_model --prefix MyApp.Py), "--out is required"},
        {~w(--module my_model --prefix MyApp.Py --out /abs/py),
         ~s(--out "/abs/py" must be a folder inside the project)},
        {~w(--module my_model --prefix MyApp.Py --out ../py),
         ~s(--out "../py" must be a folder inside the project)},
        {~w(--module my_model --prefix MyApp.Py --out lib/x.ex),
         ~s(--out "lib/x.ex" names a file)},
        {~w(--module my_model --prefix MyApp.Py --out afile), ~s(--out "afile" names a file)},
        {["--module", "my_model", "--prefix", "MyApp.Py", "--out", ""],
         ~s(--out "" is not a folder path)},
        {~w(--module my-model --prefix MyApp.Py --out lib/py),
         ~s(--module "my-model" is not a dotted Python module name)},
        {~w(--module os/path --prefix MyApp.Py --out lib/py), ~s(--module "os/path" is not)},
        {~w(--module vllm_bridge.forward_context --prefix MyApp.Py --out lib/py),
         "--module vllm_bridge.forward_context is a module of the vllm_bridge library"},
        {ok ++ ~w(--chek), "unknown option --chek"},
        {ok ++ ~w(--python-path no/such/dir), ~s(--python-path "no/such/dir" is not a folder)},
        {ok ++ ~w(--from-manifests), "--from-manifests is for the library's own bindings"},
        {ok ++ ~w(extra), "unexpected arguments: extra"},
        {~w(--prefix MyApp.Py), "--prefix goes with --module"}
      ]

      for {argv, expected} <- cases do
        assert gen_task_error(dir, argv) =~ expected, inspect(argv)
      end

      assert files(dir) == ["afile"]
    end

    test "a Python without the package, and one that does not exist", %{dir: dir} do
      # An isolated system Python: no PYTHONPATH, no site-packages of the venv.
      python = Path.join(dir, "bare_python")
      File.write!(python, "#!/bin/sh\nexec /usr/bin/python3 -I \"$@\"\n")
      File.chmod!(python, 0o755)
      base = ~w(--module my_model --prefix MyApp.Py --out lib/py --python)

      assert gen_task_error(dir, base ++ [python]) =~
               "the Python #{python} has no vllm_bridge package: install it"

      assert gen_task_error(dir, base ++ ["/no/such/python"]) =~
               "the Python /no/such/python cannot be run"

      # No --python, no config, no VLLM_BRIDGE_PYTHON: says how to name one.
      old_config = Application.fetch_env(:vllm_bridge, :python)
      old_env = System.get_env("VLLM_BRIDGE_PYTHON")
      Application.delete_env(:vllm_bridge, :python)
      System.delete_env("VLLM_BRIDGE_PYTHON")

      try do
        assert gen_task_error(dir, Enum.drop(base, -1)) =~
                 "no Python interpreter: pass --python PATH"
      after
        with {:ok, v} <- old_config, do: Application.put_env(:vllm_bridge, :python, v)
        if old_env, do: System.put_env("VLLM_BRIDGE_PYTHON", old_env)
      end
    end

    test "in another app: no --module, or a library module, is an error; nothing is written" do
      dir = tmp_project!()

      File.write!(Path.join(dir, "mix.exs"), """
      defmodule VbOtherApp.MixProject do
        use Mix.Project
        def project, do: [app: :vb_other_app, version: "0.1.0"]
      end
      """)

      in_other = fn argv ->
        Mix.Project.in_project(:vb_other_app, dir, fn _ -> gen_task_error(dir, argv) end)
      end

      assert in_other.([]) =~ "name the Python modules to bind: mix vllm.gen.bindings --module"
      assert in_other.(["--check"]) =~ "name the Python modules to bind"

      assert in_other.(~w(--module vllm_bridge.dp --prefix MyApp.Py --out lib/py)) =~
               "is a module of the vllm_bridge library"

      assert files(dir) == ["mix.exs"]
    end
  end
end
