defmodule VllmBridge.Runtime.OsProcessGroupTest do
  @moduledoc """
  A port whose process is gone before this side reads it (a `python:` wrapper that forks
  the interpreter and exits at once, faster than the BEAM's first look on a loaded
  machine): its group is still known, and the interpreter in it is taken as the worker's
  Python process when it started after the port opened, and only then; with no known
  process left, such members are still the worker's to wait for and kill. Before, the
  worker refused its own interpreter's hello ("neither its own process ... nor of its
  process group"), a failure seen under load in the suite.
  """
  use ExUnit.Case, async: true

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Worker.OsProcess

  # A port whose process starts `sleep 300` in the background, says both pids, and then
  # exits (`leader: :exits`, reaped by erl_child_setup before this returns) or becomes a
  # `sleep 300` itself (`leader: :stays`): `{leader, child}`.
  defp group!(leader) do
    tail = if leader == :stays, do: "exec sleep 300", else: "exit 0"

    port =
      Port.open({:spawn_executable, "/bin/sh"}, [
        :binary,
        :exit_status,
        args: ["-c", "sleep 300 </dev/null >/dev/null 2>&1 & echo $$ $!; " <> tail]
      ])

    # (Its pid from itself: the port may be closed before Port.info could say it.)
    [leader_pid, child] =
      receive do
        {^port, {:data, line}} -> line |> String.split() |> Enum.map(&String.to_integer/1)
      after
        15_000 -> flunk("the shell said no pids within 15 s")
      end

    # (By identity: a pid of a process gone meanwhile may be another's by then.)
    for pid <- [leader_pid, child], do: kill_after_test(pid)

    if leader == :exits do
      assert_receive {^port, {:exit_status, 0}}, 15_000
      wait_until(fn -> OsProcess.ident(leader_pid) == nil end, 15_000, "the leader reaped")
    end

    {leader_pid, child}
  end

  defp orphan!, do: group!(:exits)

  test "the interpreter of a port whose process is gone is taken by its group" do
    opened_at = OsProcess.now()
    {leader, child} = orphan!()

    procs = OsProcess.spawned(leader, opened_at)
    assert %OsProcess{port: nil, group: ^leader, since: ^opened_at} = procs
    # (Of the session the port's process leads: it keeps the group's number taken.)
    assert {:ok, %OsProcess{python: {^child, _}, held: true} = procs} =
             OsProcess.python(procs, child)

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
    # (nil where /proc/uptime is not the boot clock, as under lxcfs; not this host.)
    before = OsProcess.now()
    assert is_integer(before), "/proc/uptime reads earlier than the BEAM's start"
    {_leader, child} = orphan!()
    {^child, start} = OsProcess.ident(child)
    assert start >= before
    assert OsProcess.now() >= start
  end

  test "a group whose number is a live process's other than the port's recorded one is refused" do
    # The leader lives on, but is not the process recorded as the port's: the group's
    # number would have been handed out again, so its members are no worker's.
    {leader, child} = group!(:stays)
    {^leader, start} = OsProcess.ident(leader)
    {^child, child_start} = OsProcess.ident(child)

    for port <- [nil, {leader, start + 1}] do
      procs = %OsProcess{port: port, group: leader, since: child_start}
      assert :error = OsProcess.python(procs, child)
      # Nor are they the worker's to wait for or kill.
      assert OsProcess.remaining(procs) == []
      assert :ok = OsProcess.kill_worker(procs)
    end

    Process.sleep(100)
    assert os_alive?(child) and os_alive?(leader)

    # Recorded as the port's process itself: its group's member is taken.
    procs = %OsProcess{port: {leader, start}, group: leader, since: start}
    assert {:ok, %OsProcess{python: {^child, ^child_start}}} = OsProcess.python(procs, child)
  end

  describe "with no known process left, the group's members" do
    test "started since the port opened are the worker's: remaining, and killed" do
      opened_at = OsProcess.now()
      {leader, child} = orphan!()
      procs = OsProcess.spawned(leader, opened_at)

      assert OsProcess.remaining(procs) == [child]
      refute OsProcess.gone?(procs)
      refute OsProcess.await_gone(procs, 50)
      assert :ok = OsProcess.kill_worker(procs)
      assert OsProcess.await_gone(procs, 15_000)
      refute os_alive?(child)
    end

    test "started before it are not: never signalled" do
      {leader, child} = orphan!()
      {^child, start} = OsProcess.ident(child)
      procs = OsProcess.spawned(leader, start + 1)

      assert OsProcess.remaining(procs) == []
      assert :ok = OsProcess.kill_worker(procs)
      Process.sleep(100)
      assert os_alive?(child)
    end

    test "after a hello whose process left the session are not: never signalled" do
      # Its session's number is not the group's: once it and the group's other members
      # are gone, nothing keeps that number taken, and a stranger's group may have it.
      opened_at = OsProcess.now()
      {leader, child} = orphan!()
      procs = %{OsProcess.spawned(leader, opened_at) | python: {leader, 1}, held: false}

      assert OsProcess.remaining(procs) == []
      assert OsProcess.gone?(procs)
      assert :ok = OsProcess.kill_worker(procs)
      Process.sleep(100)
      assert os_alive?(child)

      # The same with the session kept: the child is the worker's.
      assert OsProcess.remaining(%{procs | held: true}) == [child]
    end
  end
end
