defmodule VllmBridge.Runtime.OsProcessTreeTest do
  @moduledoc """
  Generated process trees under a port, against the rule of what a worker's end kills
  (VllmBridge.Worker.OsProcess): each tree is a shell, leading its group as every port's
  process does, that starts some `sleep`s in the background (in its group, as orphans of
  a subshell that exits, or in a session of their own with `setsid`), and then exits or
  stays. Whatever the shape, `kill_worker/1` ends every process of the group started
  since the port opened, and no process that left the group; `gone?/1` agrees.
  """
  use ExUnit.Case, async: true

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Worker.OsProcess

  @kinds [:child, :orphan, :own_session]

  # The shell's line for one process of `kind`, which prints `<kind> <pid>`.
  defp line(:child), do: "sleep 300 </dev/null >/dev/null 2>&1 & echo child $!"
  defp line(:orphan), do: "(sleep 300 </dev/null >/dev/null 2>&1 & echo orphan $!)"
  defp line(:own_session), do: "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo own_session $!"

  # Opens the tree's port; returns `{opened_at, leader, [{kind, pid}]}` once the shell has
  # said every pid (and, when it exits, once it is gone).
  defp tree!(kinds, leader) do
    tail = if leader == :stays, do: "exec sleep 300", else: "exit 0"
    script = Enum.map_join(kinds, "; ", &line/1) <> "; echo done $$; " <> tail
    opened_at = OsProcess.now()

    port =
      Port.open({:spawn_executable, "/bin/sh"}, [
        :binary,
        :exit_status,
        {:line, 256},
        args: ["-c", script]
      ])

    {leader_pid, procs} = read_pids(port, [])

    # The shell says a `setsid`'s pid as it forks it, before it has left the group.
    for {:own_session, pid} <- procs do
      wait_until(fn -> own_group?(pid) end, 15_000, "os pid #{pid} in a session of its own")
    end

    for {_kind, pid} <- [{:leader, leader_pid} | procs], do: kill_after_test(pid)

    if leader == :exits do
      assert_receive {^port, {:exit_status, 0}}, 15_000
      wait_until(fn -> OsProcess.ident(leader_pid) == nil end, 15_000, "the leader reaped")
    end

    {opened_at, leader_pid, procs}
  end

  # Whether `pid` leads its own group (/proc/<pid>/stat: the group is the fifth field,
  # the third after the command's name in parentheses, here `sleep` or `setsid`).
  defp own_group?(pid) do
    with {:ok, stat} <- File.read("/proc/#{pid}/stat"),
         [_, rest] <- String.split(stat, ") ", parts: 2),
         [_state, _ppid, pgrp | _] <- String.split(rest) do
      pgrp == Integer.to_string(pid)
    else
      _ -> false
    end
  end

  defp read_pids(port, acc) do
    receive do
      {^port, {:data, {:eol, "done " <> pid}}} ->
        {String.to_integer(pid), Enum.reverse(acc)}

      {^port, {:data, {:eol, line}}} ->
        [kind, pid] = String.split(line)
        read_pids(port, [{String.to_existing_atom(kind), String.to_integer(pid)} | acc])
    after
      15_000 -> flunk("the shell said no pids within 15 s (so far: #{inspect(acc)})")
    end
  end

  test "every member of the group since the port opened ends, nothing that left it" do
    seed = :erlang.unique_integer([:positive])
    :rand.seed(:exsss, {seed, 19, 25})

    for round <- 1..12 do
      kinds = for _ <- 0..:rand.uniform(4), do: Enum.random(@kinds)
      leader = Enum.random([:exits, :stays])
      {opened_at, leader_pid, procs} = tree!(kinds, leader)
      what = "round #{round} (seed #{seed}): #{inspect(kinds)}, the leader #{leader}"

      t = OsProcess.spawned(leader_pid, opened_at)
      ours = for {kind, pid} <- procs, kind != :own_session, do: pid
      theirs = for {:own_session, pid} <- procs, do: pid

      # When the hello named one of the group (its session's): the same.
      t =
        case {ours, :rand.uniform(2)} do
          {[pid | _], 1} -> elem(OsProcess.python(t, pid), 1)
          _ -> t
        end

      expected = if leader == :stays, do: [leader_pid | ours], else: ours
      assert Enum.sort(OsProcess.remaining(t)) == Enum.sort(Enum.uniq(expected)), what
      assert OsProcess.gone?(t) == (expected == []), what

      assert :ok = OsProcess.kill_worker(t)
      assert OsProcess.await_gone(t, 15_000), what
      for pid <- expected, do: refute(os_alive?(pid), "#{what}: #{pid} lives")
      for pid <- theirs, do: assert(os_alive?(pid), "#{what}: #{pid} (own session) killed")
    end
  end
end
