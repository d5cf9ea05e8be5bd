defmodule VllmBridge.Runtime.WorkerLeftoversTest do
  @moduledoc """
  A process the worker's Python code started in its process group, and that outlives
  the interpreter, ends with the worker: when the pool stops (the interpreter exits on
  EOF by itself, the child does not) it is killed after `shutdown_grace`. One started in
  a session of its own (`start_new_session=True`) has left the worker and is not
  touched. Real workers (test/support/rt_spawn.py).
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import ExUnit.CaptureLog
  import VllmBridge.RuntimeHelpers

  defp pool!(name) do
    start_pool!(name,
      size: 1,
      shutdown_grace: 500,
      allow: ["rt_spawn"],
      worker_env: [python_path([support_dir()])]
    )
  end

  defp sleeper!(pool, own_session) do
    {:ok, pid} =
      VllmBridge.call({"rt_spawn", "sleeper"}, [300, own_session], %{}, pool_name: pool)

    {^pid, _start} = kill_after_test(pid)
    pid
  end

  test "a child in the worker's group that outlives the interpreter is killed at the stop" do
    pool!(:leftovers_group)
    [w] = workers!(:leftovers_group)
    child = sleeper!(:leftovers_group, false)

    log =
      capture_log(fn ->
        :ok = VllmBridge.stop_pool(:leftovers_group)
        wait_until(fn -> not os_alive?(child) end, 15_000, "the child (os pid #{child}) gone")
      end)

    assert not os_alive?(w.os_pid)
    # Named, with the interpreter that started it, in the warning of the kill.
    assert log =~ "os pid #{w.os_pid}"
    assert log =~ ~r/os pids [\d, ]*\b#{child}\b/
  end

  test "each worker has one sentinel in its group, which the stop ends quietly" do
    # A grace a loaded machine's interpreter exits within (it takes 0.1-1 s).
    start_pool!(:leftovers_sentinel, size: 1, shutdown_grace: 15_000)
    [w] = workers!(:leftovers_sentinel)
    assert [{sentinel, _start}] = sentinels(w.os_pid)

    log =
      capture_log(fn ->
        :ok = VllmBridge.stop_pool(:leftovers_sentinel)
      end)

    # It exits with the interpreter (its parent): nothing to kill, nothing to say.
    assert not os_alive?(w.os_pid) and not os_alive?(sentinel)
    refute log =~ "killing them"
    refute log =~ "still there"
  end

  test "a worker process killed: its interpreter's sentinel is not taken for a leftover" do
    # The interpreter closes its output as it exits (EOF of its port), and its sentinel
    # exits a few ms after it: the output reader waits for both before it looks.
    start_pool!(:leftovers_killed, size: 1)

    for _round <- 1..3 do
      [w] = workers!(:leftovers_killed)
      assert [_] = sentinels(w.os_pid)
      [reader] = output_readers(w.pid)
      ref = Process.monitor(reader)

      log =
        capture_log(fn ->
          Process.exit(w.pid, :kill)
          assert_receive {:DOWN, ^ref, :process, _, _}, 30_000
        end)

      refute log =~ "still there after its worker process ended"
    end
  end

  test "a worker process killed: a child left in its group is named and killed" do
    pool!(:leftovers_killed_child)
    [w] = workers!(:leftovers_killed_child)
    [reader] = output_readers(w.pid)
    ref = Process.monitor(reader)
    child = sleeper!(:leftovers_killed_child, false)

    log =
      capture_log(fn ->
        Process.exit(w.pid, :kill)
        assert_receive {:DOWN, ^ref, :process, _, _}, 30_000
      end)

    wait_until(fn -> not os_alive?(child) end, 15_000, "the child (os pid #{child}) gone")
    assert log =~ ~r/still there after its worker process ended \(os pids [\d, ]*\b#{child}\b/
  end

  # The group's live members named as the sentinel names itself (/proc/<pid>/comm).
  defp sentinels(group) do
    for name <- File.ls!("/proc"),
        {pid, ""} <- [Integer.parse(name)],
        {:ok, "vllm-bridge-snt\n"} <- [File.read("/proc/#{pid}/comm")],
        {:ok, stat} <- [File.read("/proc/#{pid}/stat")],
        [_, rest] = String.split(stat, ") ", parts: 2),
        [_state, _ppid, pgrp | _] = String.split(rest),
        pgrp == Integer.to_string(group),
        os_alive?(pid),
        do: kill_after_test(pid)
  end

  test "a child in a session of its own is left alone" do
    pool!(:leftovers_session)
    [w] = workers!(:leftovers_session)
    child = sleeper!(:leftovers_session, true)

    :ok = VllmBridge.stop_pool(:leftovers_session)
    wait_until(fn -> not os_alive?(w.os_pid) end, 15_000, "the interpreter gone")
    # Past the stop's grace (500 ms) and the output readers' drain (2 s), after either
    # of which a kill would come: still there.
    Process.sleep(2_500)
    assert os_alive?(child)
  end
end
