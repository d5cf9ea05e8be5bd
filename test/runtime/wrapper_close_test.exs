defmodule VllmBridge.Runtime.WrapperCloseTest do
  @moduledoc """
  Whatever ends a pool's worker (its pool stopped, the worker closed, its worker process
  killed), no Python process its port started is left: also under a `python:` wrapper
  that forks the interpreter and exits at once, whose child outlives it (reparented,
  out of the port process's descendants). The Python process here ignores the EOF of
  its port (the fake worker's `deaf` mode), as one stuck in C code would: only a kill
  ends it before the test does.

  And the kill never reaches a process that is not the worker's: a pid whose process
  is not the one recorded (its start time differs: it was replaced) is refused.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Error
  alias VllmBridge.Worker.OsProcess

  # A wrapper that starts the interpreter in the background and exits without waiting
  # for it: at once (the interpreter's parent goes before its hello), or after `seconds`.
  defp fork_and_exit(tmp, seconds \\ nil) do
    wait = if seconds, do: "sleep #{seconds}\n", else: ""
    wrapper_script(tmp, &"#{&1} &\n#{wait}exit 0")
  end

  defp deaf(name, python, env \\ []) do
    opts = [
      size: 1,
      shutdown_grace: 300,
      worker_module: "runtime_fake_worker",
      worker_env: [{"PYTHONPATH", support_dir()}, {"FAKE_WORKER_MODE", "deaf"} | env]
    ]

    {:ok, _} = VllmBridge.start_pool(name, if(python, do: [python: python], else: []) ++ opts)
    on_exit(fn -> VllmBridge.stop_pool(name) end)
    [w] = workers!(name)
    python_pid = w.os_pid
    port_pid = :sys.get_state(w.pid).os_pid
    on_exit(fn -> for p <- [python_pid, port_pid], do: kill_if_ours(p) end)
    {w, port_pid, python_pid}
  end

  # (Only if it is still a Python process: a test that failed leaves none behind.)
  defp kill_if_ours(pid) do
    case File.read("/proc/#{pid}/cmdline") do
      {:ok, cmd} -> if cmd =~ "runtime_fake_worker", do: System.cmd("kill", ["-KILL", "#{pid}"])
      _ -> :ok
    end
  end

  defp assert_gone(pid, what),
    do: wait_until(fn -> not os_alive?(pid) end, 15_000, "#{what} (os pid #{pid}) gone")

  describe "a wrapper that forks the interpreter and exits" do
    @describetag :tmp_dir

    test "its child serves as the worker's Python process", %{tmp_dir: tmp} do
      {_w, port_pid, python_pid} = deaf(:wrapper_close_serve, fork_and_exit(tmp))
      assert port_pid != python_pid
      assert os_alive?(python_pid)
      assert_gone(port_pid, "the wrapper")
    end

    test "a pool stop kills its child", %{tmp_dir: tmp} do
      {_w, _port_pid, python_pid} = deaf(:wrapper_close_stop, fork_and_exit(tmp))
      :ok = VllmBridge.stop_pool(:wrapper_close_stop)
      assert_gone(python_pid, "the child of the wrapper")
    end

    test "a pool stop kills its child also when the wrapper exited after the hello",
         %{tmp_dir: tmp} do
      {_w, port_pid, python_pid} = deaf(:wrapper_close_late, fork_and_exit(tmp, 2))
      assert_gone(port_pid, "the wrapper")
      :ok = VllmBridge.stop_pool(:wrapper_close_late)
      assert_gone(python_pid, "the child of the wrapper")
    end

    test "closing the worker kills its child", %{tmp_dir: tmp} do
      {w, _port_pid, python_pid} = deaf(:wrapper_close_close, fork_and_exit(tmp))
      :ok = VllmBridge.Worker.close(w.pid)
      assert_gone(python_pid, "the child of the wrapper")
    end

    test "killing the worker process kills its child", %{tmp_dir: tmp} do
      {w, _port_pid, python_pid} = deaf(:wrapper_close_kill, fork_and_exit(tmp))
      Process.exit(w.pid, :kill)
      assert_gone(python_pid, "the child of the wrapper")
    end
  end

  test "killing the worker process kills a Python process deaf to EOF (no wrapper)" do
    {w, port_pid, python_pid} = deaf(:wrapper_close_plain_kill, nil)
    assert port_pid == python_pid
    Process.exit(w.pid, :kill)
    assert_gone(python_pid, "the Python process")
  end

  test "killing the worker process kills a Python process deaf to EOF that closed its output" do
    {w, _port_pid, python_pid} =
      deaf(:wrapper_close_quiet_kill, nil, [{"FAKE_WORKER_QUIET", "1"}])

    # Its output readers have seen the end of their FIFOs: nothing is left to drain.
    output = :sys.get_state(w.pid).output
    wait_until(fn -> :sys.get_state(output).streams == %{} end, 15_000, "both streams ended")

    Process.exit(w.pid, :kill)
    assert_gone(python_pid, "the Python process")
  end

  describe "a process that is not the one recorded is never signalled" do
    # An unrelated OS process of our own.
    defp victim! do
      port = Port.open({:spawn_executable, System.find_executable("sleep")}, args: ["300"])
      {:os_pid, pid} = Port.info(port, :os_pid)
      # (Quietly: it may be gone already.)
      on_exit(fn ->
        System.cmd("kill", ["-KILL", Integer.to_string(pid)], stderr_to_stdout: true)
      end)

      pid
    end

    test "a pid with another start time is refused, naming both" do
      victim = victim!()
      {^victim, start} = OsProcess.ident(victim)

      assert {:error, %Error{type: :bad_argument, message: msg}} =
               OsProcess.kill(victim, start + 1)

      assert msg =~ "os pid #{victim}"
      assert msg =~ "#{start + 1}"
      Process.sleep(100)
      assert os_alive?(victim)

      # Its own start time: killed.
      assert :ok = OsProcess.kill(victim, start)
      assert_gone(victim, "the process")
    end

    test "a group kill refuses -1, 0, 1, the BEAM's own pid and its group, by name" do
      beam = String.to_integer(System.pid())
      [_, group] = Regex.run(~r/\) \S+ \d+ (\d+) /, File.read!("/proc/#{beam}/stat"))

      for g <- [-1, 0, 1, beam, String.to_integer(group), nil] do
        assert {:error, %Error{type: :bad_argument, message: msg}} = OsProcess.kill_group(g)
        assert msg =~ "refusing to kill os pid #{inspect(g)}"
      end
    end

    test "a worker's recorded processes and group, all replaced, are not signalled" do
      victim = victim!()
      {^victim, start} = OsProcess.ident(victim)

      # The victim leads its own group (each port's process does): had its pid been the
      # worker's port process, the group kill would reach it.
      replaced = %OsProcess{
        port: {victim, start + 7},
        python: {victim, start + 9},
        group: victim
      }

      assert :ok = OsProcess.kill_worker(replaced)
      Process.sleep(100)
      assert os_alive?(victim)
    end
  end
end
