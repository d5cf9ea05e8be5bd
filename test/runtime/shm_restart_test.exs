defmodule VllmBridge.Runtime.ShmRestartTest do
  @moduledoc """
  The process that lends argument slots (VllmBridge.Shm) may crash and restart while the
  directory stays (docs/PROTOCOL.md, "Lifetimes"). A caller that asked it for a slot as
  it died got its exit (`:killed`, or `:noproc` while it restarted) out of
  `VllmBridge.call`, instead of sending its tensor through the pipe; and a caller whose
  slot was lent before the restart, and not read (its call refused or timed out before
  its worker read it), had it left behind for the BEAM's life: the restarted process
  ignored the names it did not lend itself. On real workers; not async (it kills the
  node's VllmBridge.Shm).
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Shm

  @pool :rt_shm_restart

  setup_all do
    start_pool!(@pool, size: 2, allow: ["vllm_bridge.bridge.diag"])
    :ok
  end

  setup do
    await_idle!(@pool)
    :ok
  end

  defp echo(t),
    do: VllmBridge.call({"vllm_bridge.bridge.diag", "echo"}, [t], %{}, pool_name: @pool)

  # (VllmBridge.Shm's supervisor allows 3 restarts in 5 s: RuntimeHelpers.restart_shm!/0
  # spaces them.)
  test "callers whose slot requests meet the death of VllmBridge.Shm send their tensors inline" do
    shm = Process.whereis(Shm)
    seed = :rand.uniform(1_000_000_000)
    :rand.seed(:exsss, {seed, 19, 3})
    n = Enum.random(1..4)
    # (No wait between the callers' requests and the kill: their calls time out in 5 s.)
    pace_shm_restart()
    :ok = :sys.suspend(shm)
    ts = for c <- 1..n, do: filled_tensor(Enum.random([1, 2, 3]), c)
    callers = for t <- ts, do: Task.async(fn -> echo(t) end)

    try do
      # The callers' requests for a slot wait in the suspended process's mailbox.
      await_takes(shm, n)

      restart_shm!()

      for {t, caller} <- Enum.zip(ts, callers),
          do: assert({:ok, ^t} = Task.await(caller, 30_000), "seed #{seed}")
    after
      if Process.alive?(shm), do: :sys.resume(shm)
    end

    # And the next call has a slot again.
    big = filled_tensor(2, 99)
    assert {:ok, ^big} = echo(big)
    assert {:ok, _} = Shm.scope(fn -> true end, fn -> Shm.put(big.data) end)
  end

  test "a slot lent before a restart and never read goes when its caller's scope ends" do
    %{path: dir} = Shm.dir()
    big = filled_tensor(2, 7)

    name =
      Shm.scope(fn -> true end, fn ->
        assert {:ok, name} = Shm.put(big.data)
        assert File.exists?(Path.join(dir, name))
        restart_shm!()
        name
      end)

    still_naming([name])

    wait_until(
      fn ->
        not Enum.any?(File.ls!(dir), &(&1 == name or String.starts_with?(&1, name <> ".")))
      end,
      15_000,
      "the unread slot #{name} goes"
    )
  end

  # A frame still in a pipe may name a slot lent before a restart: that name must never
  # be lent again. The restarted process named its slots after the highest it found in
  # the directory, so once the higher ones were gone (the unread slot deleted as its
  # call ended), a second restart lent the same names again.
  test "no argument slot name is lent twice, across restarts" do
    %{path: dir} = Shm.dir()
    shm = Process.whereis(Shm)
    # Nothing free that the next put could take again: its name is a new one.
    wait_until(fn -> :sys.get_state(shm).slots == %{} end, 15_000, "no slot tracked")
    big = filled_tensor(2, 11)

    first =
      Shm.scope(fn -> true end, fn ->
        assert {:ok, name} = Shm.put(big.data)
        restart_shm!()
        name
      end)

    wait_until(fn -> not File.exists?(Path.join(dir, first)) end, 15_000, "#{first} goes")
    restart_shm!()
    again = Shm.scope(fn -> true end, fn -> Shm.put(big.data) end)
    assert {:ok, second} = again
    assert number(second) > number(first), "#{second} lent after #{first}"
  end

  # A scope's end said late (its request met a restart, and the successor was not yet
  # registered: VllmBridge.Shm.Writer says it from a process of its own) may come while
  # the caller's next scope holds a slot the successor lent it: that slot stays lent.
  test "a scope's end said late does not settle the slot of the caller's next scope" do
    %{path: dir} = Shm.dir()

    {caller, mref, name} =
      caller_with_slot(filled_tensor(2, 15), fn ->
        receive do
          :finish -> :ok
        end
      end)

    # The late end of the caller's previous scope, which lent nothing.
    GenServer.cast(Shm, {:done, caller, []})
    assert %{slots: %{^name => %{owner: ^caller}}} = :sys.get_state(Shm)
    assert File.exists?(Path.join(dir, name))
    send(caller, :finish)
    assert_receive {:scope_ended, ^caller}, 15_000
    # Its own end settles it (never read: deleted).
    wait_until(fn -> not File.exists?(Path.join(dir, name)) end, 15_000, "#{name} goes")
    assert_receive {:DOWN, ^mref, :process, ^caller, :normal}
  end

  # A scope's end unread in the mailbox of the process that died is lost with it: the
  # adopted slot of a caller that lives on is settled once the caller's scope no longer
  # names it; one its running scope still names stays.
  test "an adopted slot whose scope's end was lost goes; one still in use stays" do
    %{path: dir} = Shm.dir()
    # A caller whose scope ended (its end lost): alive, in no scope.
    idle = spawn(fn -> Process.sleep(:infinity) end)
    on_exit(fn -> Process.exit(idle, :kill) end)
    lost = "e-#{System.unique_integer([:positive, :monotonic])}"
    File.write!(Path.join(dir, lost), "its scope's end was lost")
    true = :ets.insert(VllmBridge.Shm.Lent, {lost, idle})

    # A caller inside its scope, holding its slot.
    {busy, _, held} = caller_with_slot(filled_tensor(2, 16))
    restart_shm!()

    wait_until(
      fn -> not File.exists?(Path.join(dir, lost)) end,
      15_000,
      "the slot of the idle caller goes"
    )

    assert Process.alive?(idle) and Process.alive?(busy)
    assert File.exists?(Path.join(dir, held))
    assert %{slots: %{^held => %{owner: ^busy}}} = :sys.get_state(Shm)
  end

  # Shm.without/1 inside a scope: the scope's names stay named (the sweep keeps its slot).
  test "an adopted slot stays while its caller's scope runs Shm.without/1" do
    %{path: dir} = Shm.dir()
    me = self()

    {caller, _, name} =
      caller_with_slot(filled_tensor(2, 17), fn ->
        Shm.without(fn ->
          send(me, :without)
          Process.sleep(:infinity)
        end)
      end)

    assert_receive :without, 15_000
    restart_shm!()
    # Past the sweep's 2 s of grace, and a few sweeps.
    Process.sleep(4_000)
    assert %{slots: %{^name => %{owner: ^caller}}} = :sys.get_state(Shm)
    assert File.exists?(Path.join(dir, name))
  end

  # The restarted process lends the slots of the one before to the same callers again
  # (VllmBridge.Shm.Keeper's table outlives it): before, the monitor of a caller went
  # with the crash, and the slot of one that died meanwhile with its call unread stayed
  # until the BEAM stopped.
  test "a caller that dies after a restart, its slot unread: the slot goes" do
    %{path: dir} = Shm.dir()
    {caller, mref, name} = caller_with_slot(filled_tensor(2, 12))
    restart_shm!()
    path = Path.join(dir, name)
    assert File.exists?(path)
    Process.exit(caller, :kill)
    assert_receive {:DOWN, ^mref, :process, ^caller, :killed}
    wait_until(fn -> not File.exists?(path) end, 15_000, "the dead caller's #{name} goes")
  end

  # A slot the process had lent as it died (its name never reached the caller, who sent
  # the tensor through the pipe) is settled when that caller's scope ends.
  test "a slot lent to a caller whose reply was lost goes when the caller's scope ends" do
    %{path: dir} = Shm.dir()
    lost = "e-#{System.unique_integer([:positive, :monotonic])}"
    File.write!(Path.join(dir, lost), "lent as the process died")
    true = :ets.insert(VllmBridge.Shm.Lent, {lost, self()})
    restart_shm!()
    big = filled_tensor(2, 13)
    assert {:ok, other} = Shm.scope(fn -> true end, fn -> Shm.put(big.data) end)
    still_naming([lost, other])

    # Both go (the scope's own was never read: deleted, not kept for reuse).
    wait_until(
      fn -> not Enum.any?([lost, other], &File.exists?(Path.join(dir, &1))) end,
      15_000,
      "#{lost} and #{other} go"
    )
  end

  # The same when the scope lent nothing else: its request met the death, so its tensor
  # took the pipe, and its end still says so.
  test "a slot granted as the process died goes when the scope ends, though it lent nothing" do
    %{path: dir} = Shm.dir()
    lost = "e-#{System.unique_integer([:positive, :monotonic])}"
    File.write!(Path.join(dir, lost), "lent as the process died")
    shm = Process.whereis(Shm)
    pace_shm_restart()
    :ok = :sys.suspend(shm)
    me = self()
    big = filled_tensor(2, 14)

    # The caller outlives its scope (its death would settle the slot anyway).
    {caller, mref} =
      spawn_monitor(fn ->
        result =
          Shm.scope(fn -> true end, fn ->
            # As if the process had lent `lost` to this caller just before it was killed.
            true = :ets.insert(VllmBridge.Shm.Lent, {lost, self()})
            send(me, :asking)
            Shm.put(big.data)
          end)

        still_naming([lost])
        send(me, {:scope_ended, result})
        Process.sleep(:infinity)
      end)

    on_exit(fn -> Process.exit(caller, :kill) end)

    try do
      assert_receive :asking, 15_000
      await_takes(shm, 1)
      restart_shm!()
    after
      if Process.alive?(shm), do: :sys.resume(shm)
    end

    assert_receive {:scope_ended, :pipe}, 15_000
    refute_received {:DOWN, ^mref, _, _, _}
    wait_until(fn -> not File.exists?(Path.join(dir, lost)) end, 15_000, "#{lost} goes")
  end

  defp number("e-" <> n), do: String.to_integer(n)

  # After a scope ended: its process names `names` in its dictionary as a running
  # scope would, so that the sweep keeps them (VllmBridge.Shm.Writer.scope_names?/2)
  # and only the scope's end can settle them. (The process uses no scope after this.)
  defp still_naming(names), do: Process.put({VllmBridge.Shm, :lent}, names)

  # Until `n` requests for a slot wait in the (suspended) process's mailbox (its sweep's
  # tick may wait there too).
  defp await_takes(shm, n) do
    wait_until(
      fn ->
        {:messages, ms} = Process.info(shm, :messages)
        Enum.count(ms, &match?({:"$gen_call", _, {:take, _, _}}, &1)) == n
      end,
      4_000,
      "#{n} slot requests wait"
    )
  end

  # A process (monitored, killed at the test's end) inside a scope that was lent a slot
  # for `t`: `{pid, monitor, slot name}`. `hold` runs in the scope after the slot is lent
  # (by default for ever); once it returns, the process says `{:scope_ended, pid}`.
  defp caller_with_slot(t, hold \\ fn -> Process.sleep(:infinity) end) do
    me = self()

    {pid, mref} =
      spawn_monitor(fn ->
        Shm.scope(fn -> true end, fn ->
          send(me, {:lent, self(), Shm.put(t.data)})
          hold.()
        end)

        send(me, {:scope_ended, self()})
      end)

    on_exit(fn -> Process.exit(pid, :kill) end)
    assert_receive {:lent, ^pid, lent}, 15_000
    assert {:ok, name} = lent
    {pid, mref, name}
  end
end
