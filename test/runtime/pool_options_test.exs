defmodule VllmBridge.Runtime.PoolOptionsTest do
  @moduledoc """
  The pool options for one's own Python code: `python:` and where the interpreter comes
  from without it, `python_path:`, `modules:` beside the default allow-list (and `allow:`
  replacing it), and `worker_env:` as `{m, f, a}` (what `config/*.exs` of a release can
  hold). Real workers throughout.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Pool}

  @own_dir Path.expand("../support/own_modules", __DIR__)
  @env "VLLM_BRIDGE_PYTHON"

  # worker_env's {m, f, a}: called with the worker's index first.
  @doc false
  def rank_env(index, tag), do: [{"VB_TAG", tag}, {"VB_RANK", Integer.to_string(index)}]

  defp bad!(opts) do
    assert {:error, %Error{type: :bad_argument, message: m}} =
             VllmBridge.start_pool(:vb_bad_opts, opts)

    refute :vb_bad_opts in Pool.names()
    m
  end

  # Runs `fun` with no `config :vllm_bridge, :python` and VLLM_BRIDGE_PYTHON set to `value`
  # (unset for nil), as in an app that depends on the library.
  defp with_python_env(value, fun) do
    old_app = Application.get_env(:vllm_bridge, :python)
    old_env = System.get_env(@env)
    Application.delete_env(:vllm_bridge, :python)
    if value, do: System.put_env(@env, value), else: System.delete_env(@env)

    try do
      fun.()
    after
      Application.put_env(:vllm_bridge, :python, old_app)
      if old_env, do: System.put_env(@env, old_env), else: System.delete_env(@env)
    end
  end

  # `path` relative to the current folder, with ".." where it lies outside it.
  defp relative_from_cwd(path) do
    from = Path.split(File.cwd!())
    to = Path.split(path)
    common = Enum.zip(from, to) |> Enum.take_while(fn {a, b} -> a == b end) |> length()
    ups = List.duplicate("..", length(from) - common)
    Path.join(ups ++ Enum.drop(to, common))
  end

  defp own(pool, fun, args \\ []),
    do: VllmBridge.call({"vb_own_mod", fun}, args, %{}, pool_name: pool)

  describe "python:" do
    test "without the option, the config or #{@env}, the error says how to give one" do
      with_python_env(nil, fn ->
        m = bad!(size: 1)
        assert m =~ "no Python interpreter"
        assert m =~ "python:" and m =~ @env and m =~ "config :vllm_bridge"
      end)
    end

    test "#{@env} is read when the pool starts" do
      python = Application.fetch_env!(:vllm_bridge, :python)

      with_python_env("/no/such/python-from-env", fn ->
        assert bad!(size: 1) =~ "/no/such/python-from-env"
      end)

      with_python_env(python, fn ->
        start_pool!(:vb_env_python, size: 1)
        diag = {"vllm_bridge.bridge.diag", "info"}
        assert {:ok, %{"pid" => _}} = VllmBridge.call(diag, [], %{}, pool_name: :vb_env_python)
      end)
    end

    test "the option wins over the config and the environment" do
      with_python_env("/no/such/python-from-env", fn ->
        assert bad!(python: "/no/such/python-option") =~ "/no/such/python-option"
      end)
    end

    test "a relative path is made absolute when the pool starts" do
      python = Application.fetch_env!(:vllm_bridge, :python)
      rel = relative_from_cwd(python)
      assert Path.type(rel) == :relative
      start_pool!(:vb_rel_python, size: 1, python: rel)
      [%{os_pid: os_pid}] = workers!(:vb_rel_python)
      # The process runs the interpreter by its absolute path (its argv[0]).
      [argv0 | _] = "/proc/#{os_pid}/cmdline" |> File.read!() |> String.split(<<0>>)
      assert argv0 == python
    end

    test "a bare name is looked up on PATH, and one PATH does not have is refused by name" do
      dir = Path.join(System.tmp_dir!(), "vb-path-#{System.unique_integer([:positive])}")
      File.mkdir_p!(dir)
      command = Path.join(dir, "vb-python-on-path")
      File.write!(command, "#!/bin/sh\nexit 0\n")
      File.chmod!(command, 0o755)
      old_path = System.get_env("PATH")
      System.put_env("PATH", dir <> ":" <> old_path)

      try do
        assert VllmBridge.Pool.Options.resolve_python("vb-python-on-path") == command
      after
        System.put_env("PATH", old_path)
        File.rm_rf!(dir)
      end

      assert bad!(python: "vb-no-such-python") =~
               ~s(pool option python: "vb-no-such-python" is not a command found on PATH)
    end

    test "a python that is not a path is refused by name" do
      assert bad!(python: 42) =~ "pool option python"
    end
  end

  describe "python_path: and modules:" do
    test "one's own module is found and callable, beside the default modules" do
      start_pool!(:vb_own, size: 1, python_path: [@own_dir], modules: ["vb_own_mod"])
      assert {:ok, "own module"} = own(:vb_own, "whoami")

      assert {:ok, false} =
               VllmBridge.call(
                 {"vllm_bridge.forward_context", "is_forward_context_available"},
                 [],
                 %{},
                 pool_name: :vb_own
               )
    end

    test "python_path goes in front of the PYTHONPATH worker_env gives" do
      start_pool!(:vb_own_env,
        size: 1,
        python_path: [@own_dir],
        modules: ["vb_own_mod"],
        worker_env: [{"PYTHONPATH", "/tmp/vb-later"}]
      )

      assert {:ok, path} = own(:vb_own_env, "env", ["PYTHONPATH"])
      assert path == @own_dir <> ":/tmp/vb-later"
    end

    test "relative folders are made absolute, {app, path} is the app's folder" do
      rel = Path.relative_to_cwd(@own_dir)
      assert Path.type(rel) == :relative

      start_pool!(:vb_own_rel,
        size: 1,
        python_path: [rel, {:vllm_bridge, "priv"}],
        modules: ["vb_own_mod"]
      )

      assert {:ok, path} = own(:vb_own_rel, "env", ["PYTHONPATH"])
      [first, second | _] = String.split(path, ":")
      assert first == @own_dir
      assert second == Application.app_dir(:vllm_bridge, "priv")
    end

    test "allow: replaces the default list, and modules: is added to it" do
      start_pool!(:vb_own_allow,
        size: 1,
        python_path: [@own_dir],
        allow: ["vllm_bridge.bridge.diag"],
        modules: ["vb_own_mod"]
      )

      assert {:ok, "own module"} = own(:vb_own_allow, "whoami")

      assert {:error, %Error{type: :bad_argument, message: m}} =
               VllmBridge.call(
                 {"vllm_bridge.forward_context", "is_forward_context_available"},
                 [],
                 %{},
                 pool_name: :vb_own_allow
               )

      assert m =~ "vllm_bridge.forward_context"
    end

    test "without modules: one's own module is refused by name" do
      start_pool!(:vb_own_refused, size: 1, python_path: [@own_dir])
      assert {:error, %Error{type: :bad_argument, message: m}} = own(:vb_own_refused, "whoami")
      assert m =~ "vb_own_mod"
    end

    test "bad folders and module names are refused by name before anything starts" do
      assert bad!(python_path: "/tmp") =~ "python_path"
      assert bad!(python_path: ["/no/such/folder"]) =~ ~s("/no/such/folder" is not a folder)
      file = Path.join(@own_dir, "vb_own_mod.py")
      assert bad!(python_path: [file]) =~ "is not a folder"
      assert bad!(python_path: ["/tmp:/usr"]) =~ "contains a ':'"
      assert bad!(python_path: [42]) =~ "got 42"
      assert bad!(python_path: [{:no_such_app_vb, "priv"}]) =~ "no application :no_such_app_vb"

      for bad <- ["my model", "os;rm", "", ".x", "x.", "1abc", :atom] do
        assert bad!(modules: [bad]) =~ "pool option modules"
        assert bad!(allow: [bad]) =~ "pool option allow"
      end
    end
  end

  describe "worker_env: {m, f, a}" do
    test "is called with each worker's index first" do
      start_pool!(:vb_mfa,
        size: 2,
        python_path: [@own_dir],
        modules: ["vb_own_mod"],
        worker_env: {__MODULE__, :rank_env, ["t"]}
      )

      # Each worker's OS process has its own index in its environment.
      for %{index: i, os_pid: os_pid} <- workers!(:vb_mfa) do
        environ = "/proc/#{os_pid}/environ" |> File.read!() |> String.split(<<0>>)
        assert "VB_RANK=#{i}" in environ
        assert "VB_TAG=t" in environ
      end

      assert {:ok, "t"} = own(:vb_mfa, "env", ["VB_TAG"])
    end

    test "a missing function, a raise or a bad result is refused by name" do
      assert bad!(worker_env: {__MODULE__, :no_such_fun, []}) =~ "no_such_fun/1 is not a function"
      assert bad!(worker_env: {__MODULE__, :rank_env, []}) =~ "rank_env/1 is not a function"
      assert bad!(worker_env: {String, :to_integer, []}) =~ "worker 0's environment"
      assert bad!(worker_env: fn _ -> raise "boom" end) =~ "boom"
      assert bad!(worker_env: fn _ -> [{"A", %{}}] end) =~ "must be [{name, value}]"
    end

    test "the launcher's own variables are refused by name, in every form and spelling" do
      for name <-
            ["VLLM_BRIDGE_STDERR_FILE", "VLLM_BRIDGE_STDERR_FD", "VLLM_BRIDGE_BEAM"] ++
              VllmBridge.Shm.own_env(),
          key <- [name, String.to_atom(name)],
          env <- [
            [{"OK", "1"}, {key, "/tmp/x"}],
            fn i -> [{key, i}] end,
            {__MODULE__, :env_with, [key]}
          ] do
        m = bad!(worker_env: env)
        assert m =~ "worker_env", m
        assert m =~ "sets #{name}", m
        assert m =~ "launcher", m
      end

      # Both at once: both named.
      m = bad!(worker_env: [{"VLLM_BRIDGE_STDERR_FD", "5"}, {"VLLM_BRIDGE_STDERR_FILE", "f"}])
      assert m =~ "VLLM_BRIDGE_STDERR_FD, VLLM_BRIDGE_STDERR_FILE"
    end
  end

  @doc false
  def env_with(index, key), do: [{key, Integer.to_string(index)}]
end
