defmodule VllmBridge.Runtime.HelloPidTest do
  @moduledoc """
  The pid a worker's hello announces is only a claim: the process this side kills (a
  frame header over the limit, a cancelled call that overstays, a close that lingers) is
  the port's own OS process, and a hello naming any process other than that one or one
  of its descendants is refused (a fake worker, test/support/runtime_fake_worker.py, that
  lies about its pid). A `python:` wrapper that forks, whose Python process is a child of
  the port's, still works, and both processes go when the worker is killed.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Pool}
  alias VllmBridge.Worker.OsProcess

  defp fake(mode, env) do
    [
      size: 1,
      worker_module: "runtime_fake_worker",
      worker_env: [{"PYTHONPATH", support_dir()}, {"FAKE_WORKER_MODE", mode} | env]
    ]
  end

  # An unrelated OS process of our own (not a descendant of any worker's).
  defp victim! do
    port = Port.open({:spawn_executable, System.find_executable("sleep")}, args: ["300"])
    {:os_pid, pid} = Port.info(port, :os_pid)
    on_exit(fn -> System.cmd("kill", ["-KILL", Integer.to_string(pid)]) end)
    pid
  end

  # A pool that started although it should not have is stopped when the test ends.
  defp start(name, opts) do
    result = VllmBridge.start_pool(name, opts)
    if match?({:ok, _}, result), do: on_exit(fn -> VllmBridge.stop_pool(name) end)
    result
  end

  test "a hello naming an unrelated process is refused, and that process is never killed" do
    victim = victim!()
    env = [{"FAKE_WORKER_HELLO_PID", "#{victim}"}, {"FAKE_WORKER_CALLS", "1"}]
    result = start(:hello_pid_victim, fake("huge_header", env))

    # Had the hello been taken, the header over the limit that answers the first call
    # would have the worker killed: the process the hello named must survive that.
    if match?({:ok, _}, result) do
      VllmBridge.call({"m", "f"}, [], %{}, pool_name: :hello_pid_victim, timeout: 30_000)
      Process.sleep(500)
    end

    assert os_alive?(victim), "the process the hello named (os pid #{victim}) was killed"
    assert {:error, %Error{type: :protocol, message: msg}} = result
    assert msg =~ "os pid #{victim}"
    assert [_, own] = Regex.run(~r/its own process \(os pid (\d+)\)/, msg)
    assert String.to_integer(own) != victim
    assert Pool.names() |> Enum.member?(:hello_pid_victim) == false
  end

  test "a hello naming pid -1 or 0 is refused by name" do
    for pid <- [-1, 0], do: assert_pid_refused(:"hello_pid_#{pid + 1}", pid)
  end

  test "a hello naming pid 1 or the BEAM's own is refused by name" do
    for pid <- [1, String.to_integer(System.pid())],
        do: assert_pid_refused(:"hello_pid_#{pid}", pid)
  end

  # A pool whose worker's hello names `pid` does not start, and says which pid.
  defp assert_pid_refused(name, pid) do
    result = start(name, fake("serve", [{"FAKE_WORKER_HELLO_PID", "#{pid}"}]))

    assert match?({:error, %Error{type: :protocol}}, result), "pid #{pid}: #{inspect(result)}"
    {:error, %Error{message: msg}} = result

    assert msg =~ "os pid #{pid}"
  end

  test "OsProcess.kill/1 refuses -1, 0, 1, the BEAM's own pid and what is not a pid, by name" do
    beam = String.to_integer(System.pid())

    for pid <- [-1, 0, 1, beam, nil, "123", 1.5] do
      assert {:error, %Error{type: :bad_argument, message: msg}} = OsProcess.kill(pid)
      assert msg =~ "refusing to kill os pid #{inspect(pid)}"
    end
  end

  test "descendant?/2 follows the parents: a child of ours, not an unrelated process" do
    beam = String.to_integer(System.pid())
    victim = victim!()
    assert OsProcess.descendant?(victim, beam)
    assert OsProcess.descendant?(victim, victim)
    refute OsProcess.descendant?(beam, victim)
    refute OsProcess.descendant?(victim, 1)
    refute OsProcess.descendant?(-1, beam)
    refute OsProcess.descendant?(victim, -1)
  end

  describe "a python: wrapper that forks the interpreter" do
    # A wrapper that runs the interpreter as its child (it waits for it), not by exec.
    defp forking_wrapper(tmp), do: wrapper_script(tmp, &"#{&1}\nstatus=$?\nexit $status")

    # The worker's two processes: the port's (the wrapper) and the Python one (its hello's).
    defp processes(pool) do
      [%{pid: w, os_pid: python_pid}] = workers!(pool)
      port_pid = :sys.get_state(w).os_pid
      {port_pid, python_pid}
    end

    @tag :tmp_dir
    test "its Python process, a child of the port's, is taken, and serves", %{tmp_dir: tmp} do
      start_pool!(:hello_pid_fork,
        size: 1,
        python: forking_wrapper(tmp),
        allow: ["vllm_bridge.bridge.diag"]
      )

      {port_pid, python_pid} = processes(:hello_pid_fork)
      assert port_pid != python_pid
      assert OsProcess.descendant?(python_pid, port_pid)

      assert {:ok, 3} =
               VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [1, 2], %{},
                 pool_name: :hello_pid_fork,
                 timeout: 30_000
               )
    end

    @tag :tmp_dir
    test "a header over the limit kills both its processes", %{tmp_dir: tmp} do
      # It sleeps after the header: only a kill ends it before the test does.
      opts = fake("huge_header", [{"FAKE_WORKER_CALLS", "1"}, {"FAKE_WORKER_LINGER", "1"}])
      start_pool!(:hello_pid_fork_huge, [python: forking_wrapper(tmp)] ++ opts)
      {port_pid, python_pid} = processes(:hello_pid_fork_huge)
      assert port_pid != python_pid

      assert {:error, %Error{type: :worker_exit}} =
               VllmBridge.call({"m", "f"}, [], %{},
                 pool_name: :hello_pid_fork_huge,
                 timeout: 30_000
               )

      wait_until(fn -> not os_alive?(python_pid) end, 10_000, "the Python process gone")
      wait_until(fn -> not os_alive?(port_pid) end, 10_000, "the wrapper gone")
    end
  end
end
