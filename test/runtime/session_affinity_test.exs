defmodule VllmBridge.Runtime.SessionAffinityTest do
  @moduledoc """
  Affinity of a session's calls when the session's worker is busy (filled with hold/1):
  `:strict_queue` waits for it, `:strict_fail_fast` fails at once with `:pool_busy`,
  `:hint` moves a state-free call to another worker but keeps a call carrying a
  reference at home; the queue serves `:strict_queue` waiters in order meanwhile. (With
  the default `max_in_flight`: test/runtime/session_busy_test.exs.)
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Pool, Ref, Session, Worker}
  alias VllmBridge.Pool.Slots

  # Two workers, one call in flight each: one hold/1 fills a worker.
  @pool :rt_aff

  setup_all do
    start_pool!(@pool, size: 2, max_in_flight: 1, queue_size: 8)
    :ok
  end

  setup do
    {ws, meta} = await_idle!(@pool)
    %{ws: ws, meta: meta}
  end

  defp diag(fun, args, opts),
    do: VllmBridge.call({"vllm_bridge.bridge.diag", fun}, args, %{}, opts)

  defp open!(opts) do
    {:ok, s} = Session.open([pool_name: @pool] ++ opts)
    on_exit(fn -> Session.close(s) end)
    s
  end

  defp status(ws, i) do
    {:ok, st} = Worker.ping(Enum.at(ws, i).pid)
    st
  end

  describe "affinity when the session's worker is busy" do
    test ":strict_queue waits for the session's worker", %{ws: ws, meta: meta} do
      s = open!(worker: 0)
      home = Enum.at(ws, 0).os_pid
      held = hold(pool_name: @pool, session_id: s.id)
      assert Slots.load(meta, 0) == 1 and Slots.load(meta, 1) == 0

      waiter = Task.async(fn -> diag("info", [], session_id: s.id, affinity: :strict_queue) end)
      wait_until(fn -> Slots.waiting(meta) == 1 end)
      # Queued for worker 0 although worker 1 is idle.
      assert Slots.load(meta, 1) == 0
      assert Task.yield(waiter, 0) == nil

      assert :released = unhold(held)
      assert {:ok, %{"pid" => ^home}} = Task.await(waiter, 30_000)
    end

    test ":strict_queue is the default" do
      s = open!(worker: 1)
      {:ok, meta} = Pool.meta(@pool)
      held = hold(pool_name: @pool, session_id: s.id)
      waiter = Task.async(fn -> diag("add", [1, 2], session_id: s.id) end)
      wait_until(fn -> Slots.waiting(meta) == 1 end)
      unhold(held)
      assert {:ok, 3} = Task.await(waiter, 30_000)
    end

    test ":strict_fail_fast fails at once with :pool_busy", %{meta: meta} do
      s = open!(worker: 1)
      assert {:ok, 2} = diag("add", [1, 1], session_id: s.id, affinity: :strict_fail_fast)
      {:ok, ref} = diag("opaque", [0], session_id: s.id)
      held = hold(pool_name: @pool, session_id: s.id)

      assert {:error, %Error{type: :pool_busy, message: msg}} =
               diag("add", [1, 1], session_id: s.id, affinity: :strict_fail_fast)

      assert msg =~ "worker 1" and msg =~ ":strict_fail_fast"

      # Bound to a reference: the same.
      assert {:error, %Error{type: :pool_busy}} =
               VllmBridge.call({ref, "bump"}, [], %{}, affinity: :strict_fail_fast)

      # Nothing was queued or left reserved.
      assert Slots.waiting(meta) == 0
      assert Slots.load(meta, 1) == 1
      unhold(held)
      # The slot comes back once the worker has answered the cancelled stream.
      wait_until(fn -> Slots.load(meta, 1) == 0 end)
      assert {:ok, 3} = diag("add", [1, 2], session_id: s.id, affinity: :strict_fail_fast)
    end

    test "the queue serves :strict_queue waiters in order; fail-fast and hint pass it by",
         %{ws: [_, %{os_pid: away}], meta: meta} do
      s = open!(worker: 0)
      assert {:ok, nil} = diag("set_var", [0], session_id: s.id)
      held = hold(pool_name: @pool, session_id: s.id)

      # Each waiter sets the session's variable and gets the one before: the order in
      # which the worker ran them.
      waiters =
        for n <- 1..4 do
          t = Task.async(fn -> diag("set_var", [n], session_id: s.id) end)
          wait_until(fn -> Slots.waiting(meta) == n end)
          t
        end

      assert {:error, %Error{type: :pool_busy}} =
               diag("add", [1, 1], session_id: s.id, affinity: :strict_fail_fast)

      assert {:ok, %{"pid" => ^away}} = diag("info", [], session_id: s.id, affinity: :hint)
      assert Slots.waiting(meta) == 4

      unhold(held)

      assert Enum.map(waiters, &Task.await(&1, 30_000)) == [
               {:ok, 0},
               {:ok, 1},
               {:ok, 2},
               {:ok, 3}
             ]
    end

    test ":hint runs a state-free call elsewhere, and is closed there too", %{ws: ws} do
      s = open!(worker: 0)
      [%{os_pid: home}, %{os_pid: away}] = ws
      # Idle home: the call stays home.
      assert {:ok, %{"pid" => ^home}} = diag("info", [], session_id: s.id, affinity: :hint)

      sessions_away = status(ws, 1)["sessions"]
      held = hold(pool_name: @pool, session_id: s.id)
      assert {:ok, %{"pid" => ^away}} = diag("info", [], session_id: s.id, affinity: :hint)
      # It ran under the session's id over there.
      assert status(ws, 1)["sessions"] == sessions_away + 1
      unhold(held)

      :ok = Session.close(s)
      assert status(ws, 1)["sessions"] == sessions_away
    end

    test ":hint keeps a call that carries a reference at home", %{meta: meta} do
      s = open!(worker: 0)
      {:ok, ref} = diag("opaque", [10], session_id: s.id)
      held = hold(pool_name: @pool, session_id: s.id)

      in_args = Task.async(fn -> diag("echo", [[ref]], session_id: s.id, affinity: :hint) end)
      wait_until(fn -> Slots.waiting(meta) == 1 end)

      on_ref =
        Task.async(fn ->
          VllmBridge.call({ref, "bump"}, [], %{}, session_id: s.id, affinity: :hint)
        end)

      wait_until(fn -> Slots.waiting(meta) == 2 end)
      # Worker 1 stayed idle: both wait for worker 0.
      assert Slots.load(meta, 1) == 0

      unhold(held)
      # Every reply gets a new reference to the object, in the same session and worker.
      assert {:ok, [%Ref{instance: inst, session: sid, id: id}]} = Task.await(in_args, 30_000)
      assert {inst, sid} == {ref.instance, ref.session} and id != ref.id
      assert {:ok, 11} = Task.await(on_ref, 30_000)
    end
  end
end
