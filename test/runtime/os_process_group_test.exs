defmodule VllmBridge.Runtime.OsProcessGroupTest do
  @moduledoc """
  A port whose process is gone before this side reads it (a `python:` wrapper that forks
  the interpreter and exits at once, faster than the BEAM's first look on a loaded
  machine): its group is still known, and the interpreter in it is taken as the worker's
  Python process when it started after the port opened, and only then. Before, the
  worker refused its own interpreter's hello ("neither its own process ... nor of its
  process group"), a failure seen under load in the suite.
  """
  use ExUnit.Case, async: true

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Worker.OsProcess

  # A port whose process starts `sleep 300` in the background and exits: the child's pid
  # and the port's, once the port's process is gone (reaped by erl_child_setup).
  defp orphan! do
    port =
      Port.open({:spawn_executable, "/bin/sh"}, [
        :binary,
        :exit_status,
        args: ["-c", "sleep 300 </dev/null >/dev/null 2>&1 & echo $$ $!"]
      ])

    # (Its pid from itself: the port may be closed before Port.info could say it.)
    [leader, child] =
      receive do
        {^port, {:data, line}} -> line |> String.split() |> Enum.map(&String.to_integer/1)
      end

    assert_receive {^port, {:exit_status, 0}}, 15_000
    on_exit(fn -> System.cmd("kill", ["-KILL", "#{child}"], stderr_to_stdout: true) end)
    wait_until(fn -> not File.exists?("/proc/#{leader}") end, 15_000, "the port's process reaped")
    {leader, child}
  end

  test "the interpreter of a port whose process is gone is taken by its group" do
    opened_at = OsProcess.now()
    {leader, child} = orphan!()

    procs = OsProcess.spawned(leader, opened_at)
    assert %OsProcess{port: nil, group: ^leader, since: ^opened_at} = procs
    assert {:ok, %OsProcess{python: {^child, _}} = procs} = OsProcess.python(procs, child)

    # And it is the worker's to kill: the group is signalled while it is in it.
    assert :ok = OsProcess.kill_worker(procs)
    wait_until(fn -> not os_alive?(child) end, 15_000, "the child killed")
  end

  test "a process of that group started before the port opened is refused" do
    {leader, child} = orphan!()
    {^child, start} = OsProcess.ident(child)

    assert :error = OsProcess.python(OsProcess.spawned(leader, start + 1), child)
    assert os_alive?(child)
  end

  test "a process of another group is refused, and nothing is known without a clock" do
    opened_at = OsProcess.now()
    {leader, _child} = orphan!()
    beam = String.to_integer(System.pid())

    assert :error = OsProcess.python(OsProcess.spawned(leader, opened_at), beam)
    assert %OsProcess{} == OsProcess.spawned(leader)
    assert :error = OsProcess.python(OsProcess.spawned(leader), beam)
  end

  test "now/0 is the clock of a process's start time" do
    before = OsProcess.now()
    {_leader, child} = orphan!()
    {^child, start} = OsProcess.ident(child)
    assert start >= before
    assert OsProcess.now() >= start
  end
end
