defmodule VllmBridge.Runtime.OnStartTest do
  @moduledoc """
  The pool option `on_start:`: a Python call each worker makes after its handshake and
  before it takes any call, again after every restart; a failing one stops the pool's
  start with the Python error, one not on the allow-list is named, bad forms are refused.
  Real workers; the setup is test/support/own_modules/vb_setup_mod.py (per-process state).
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import ExUnit.CaptureLog
  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Pool}
  alias VllmBridge.Worker.OsProcess

  @own_dir Path.expand("../support/own_modules", __DIR__)
  @own [python_path: [@own_dir], modules: ["vb_setup_mod"]]

  defp use_model(pool), do: VllmBridge.call({"vb_setup_mod", "use"}, [], %{}, pool_name: pool)

  test "an on_start that returns an object leaves no reference held in the worker" do
    start_pool!(:os_ref,
      size: 1,
      allow: ["vllm_bridge.bridge.diag"],
      on_start: {"vllm_bridge.bridge.diag", "opaque", [1]}
    )

    workers!(:os_ref)
    # Its result is nobody's: the reference in it is released once the worker is ready.
    wait_until(fn ->
      {:ok, status} = Pool.status(:os_ref)
      Enum.map(status.workers, & &1.refs) == [0]
    end)
  end

  test "every worker is set up before its first call: 6 calls on 2 workers all find it" do
    start_pool!(:os_two, @own ++ [size: 2, on_start: {"vb_setup_mod", "setup", ["m1"]}])

    results =
      1..6
      |> Enum.map(fn _ -> Task.async(fn -> use_model(:os_two) end) end)
      |> Enum.map(&Task.await(&1, 30_000))

    assert Enum.all?(results, &match?({:ok, %{"tag" => "m1", "setups" => 1}}, &1)),
           inspect(results)

    # Each process ran its own setup once, and both served.
    {:ok, states} = VllmBridge.call_all(:os_two, {"vb_setup_mod", "use"})
    os_pids = Enum.map(workers!(:os_two), & &1.os_pid)
    assert Enum.map(states, & &1["pid"]) == os_pids
    assert Enum.all?(states, &(&1["setups"] == 1))
    assert Enum.sum(Enum.map(states, & &1["calls"])) == 6 + 2
  end

  test "kwargs reach the setup (the four-element form)" do
    start_pool!(
      :os_kw,
      @own ++ [size: 1, on_start: {"vb_setup_mod", "setup", ["ab"], %{times: 2}}]
    )

    assert {:ok, %{"tag" => "abab"}} = use_model(:os_kw)
  end

  test "a worker is not registered, and a call waits, until its on_start returned" do
    dir = Path.join(System.tmp_dir!(), "vb-gate-#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf!(dir) end)
    started = Path.join(dir, "started")
    gate = Path.join(dir, "gate")

    opts = @own ++ [size: 1, on_start: {"vb_setup_mod", "gated_setup", [started, gate, "g"]}]
    starter = Task.async(fn -> VllmBridge.start_pool(:os_gate, opts) end)
    on_exit(fn -> VllmBridge.stop_pool(:os_gate) end)

    # The handshake is done and the setup runs (it wrote `started`), held at the gate.
    wait_until(fn -> File.exists?(started) end, 60_000, "the setup to begin")
    assert {:ok, [nil]} = Pool.workers(:os_gate)
    caller = Task.async(fn -> use_model(:os_gate) end)
    refute Task.yield(caller, 200)
    refute Task.yield(starter, 0)

    File.write!(gate, "")
    assert {:ok, _sup} = Task.await(starter, 30_000)
    assert {:ok, %{"tag" => "g", "setups" => 1}} = Task.await(caller, 30_000)
  end

  test "a restarted worker runs on_start again before it serves" do
    start_pool!(:os_restart, @own ++ [size: 2, on_start: {"vb_setup_mod", "setup", ["r"]}])
    [w0, w1] = workers!(:os_restart)

    OsProcess.kill(w0.os_pid)

    # Serving again with a new process at index 0 (the old one's entry may linger until
    # its exit status is read).
    wait_until(
      fn ->
        match?({:ok, [%{os_pid: p}, %{}]} when p != w0.os_pid, Pool.workers(:os_restart))
      end,
      60_000,
      "worker 0 restarted"
    )

    [n0, n1] = workers!(:os_restart)
    assert n0.os_pid != w0.os_pid
    assert n1.os_pid == w1.os_pid

    {:ok, [s0, s1]} = VllmBridge.call_all(:os_restart, {"vb_setup_mod", "use"})
    assert %{"pid" => pid0, "tag" => "r", "setups" => 1} = s0
    assert pid0 == n0.os_pid
    assert %{"pid" => pid1, "setups" => 1} = s1
    assert pid1 == w1.os_pid
  end

  test "a call sent while a restarted worker runs its on_start waits for it, never " <>
         "finds the worker without its setup" do
    dir = Path.join(System.tmp_dir!(), "vb-regate-#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf!(dir) end)
    started = Path.join(dir, "started")
    gate = Path.join(dir, "gate")
    File.write!(gate, "")

    start_pool!(
      :os_regate,
      @own ++ [size: 1, on_start: {"vb_setup_mod", "gated_setup", [started, gate, "re"]}]
    )

    [w0] = workers!(:os_regate)
    # The next setup (the restart's) waits at the gate.
    File.rm!(gate)
    File.rm!(started)
    OsProcess.kill(w0.os_pid)

    # The new process has done its handshake and holds in its setup: a call now waits.
    wait_until(fn -> File.exists?(started) end, 60_000, "the restarted worker's setup")
    new_pid = started |> File.read!() |> String.to_integer()
    assert new_pid != w0.os_pid
    caller = Task.async(fn -> use_model(:os_regate) end)
    refute Task.yield(caller, 200)
    assert {:ok, [nil]} = Pool.workers(:os_regate)

    File.write!(gate, "")
    assert {:ok, %{"tag" => "re", "setups" => 1, "pid" => ^new_pid}} = Task.await(caller, 30_000)
  end

  test "an on_start that raises: start_pool returns the Python error, named, logged once" do
    log =
      capture_log(fn ->
        assert {:error, %Error{type: :python_exception} = e} =
                 VllmBridge.start_pool(
                   :os_fail,
                   @own ++ [size: 1, on_start: {"vb_setup_mod", "fail", ["no weights here"]}]
                 )

        assert e.python_type == "ValueError"
        assert e.traceback =~ "ValueError: no weights here"
        assert e.message =~ "pool :os_fail did not start"
        assert e.message =~ "worker 0"
        assert e.message =~ "on_start vb_setup_mod.fail"
        assert e.message =~ "no weights here"
      end)

    # Logged once: the worker was not restarted while start_pool waited.
    assert length(String.split(log, "failed: no weights here")) - 1 == 1
    # ... with the Python traceback, readable (real lines, not an inspected string).
    assert log =~ "\nTraceback (most recent call last):\n"
    refute :os_fail in Pool.names()
  end

  test "every worker fails once, none is retried while start_pool waits" do
    log =
      capture_log(fn ->
        assert {:error,
                %Error{
                  python_type: "ValueError",
                  message: "pool :os_fail3 did not start: worker 0 " <> _
                }} =
                 VllmBridge.start_pool(
                   :os_fail3,
                   @own ++ [size: 3, on_start: {"vb_setup_mod", "fail", ["nope-3"]}]
                 )
      end)

    # start_pool waits for worker 0 first: its failure, logged once, is the one returned.
    # The others are stopped with the pool, each before or after its own failure: at most
    # one failed start each, never a retry.
    failures = Regex.scan(~r/:os_fail3\[(\d)\] failed to start/, log, capture: :all_but_first)
    assert Enum.count(failures, &(&1 == ["0"])) == 1, log
    assert Enum.uniq(failures) == failures, log
    assert length(String.split(log, "failed: nope-3")) - 1 == length(failures), log
  end

  test "an on_start module that is not allow-listed is :bad_argument naming it" do
    assert {:error, %Error{type: :bad_argument, message: m}} =
             VllmBridge.start_pool(:os_not_allowed,
               size: 1,
               python_path: [@own_dir],
               on_start: {"vb_setup_mod", "setup", ["x"]}
             )

    assert m =~
             "on_start vb_setup_mod.setup failed: module 'vb_setup_mod' is not in the " <>
               "worker's allow-list"

    assert m =~
             ~s{(a module of one's own goes on it with the pool option modules: ["vb_setup_mod"])}

    refute :os_not_allowed in Pool.names()
  end

  test "an on_start that reaches a module outside the allow-list: no hint to list its own" do
    # vb_setup_mod is listed; the path vb_setup_mod.os is the module os, which the guard
    # refuses (its words name "a module outside the allow-list" too): modules: would not
    # cure that, and vb_setup_mod is on it already.
    assert {:error, %Error{type: :bad_argument, message: m}} =
             VllmBridge.start_pool(
               :os_foreign,
               @own ++ [size: 1, on_start: {"vb_setup_mod", "os", []}]
             )

    assert m =~ "on_start vb_setup_mod.os failed"
    assert m =~ "a module outside the allow-list"
    refute m =~ "modules:"
    refute :os_foreign in Pool.names()
  end

  test "bad forms are refused by the options, naming the value" do
    for bad <- [
          {:vb_setup_mod, "setup", []},
          {"vb_setup_mod", :setup, []},
          {"vb_setup_mod", "setup"},
          {"vb_setup_mod", "setup", "x"},
          {"vb_setup_mod", "setup", [], "kw"},
          {"vb setup", "setup", []},
          {"vb_setup_mod", "set-up", []},
          {"vb_setup_mod", "setup", [self()]},
          "vb_setup_mod.setup",
          fn -> :ok end
        ] do
      assert {:error, %Error{type: :bad_argument, message: m}} =
               VllmBridge.start_pool(:os_bad, size: 1, on_start: bad)

      assert m =~ "on_start", inspect(bad)
      assert m =~ inspect(bad, limit: 8) or m =~ "cannot be sent", "#{inspect(bad)}: #{m}"
    end

    refute :os_bad in Pool.names()
  end
end
