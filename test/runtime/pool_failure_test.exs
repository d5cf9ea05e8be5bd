defmodule VllmBridge.Runtime.PoolFailureTest do
  @moduledoc """
  A pool under stress: a bounded queue that fills, deadlines that cover queueing, a
  timed-out call whose late reply is dropped, a worker stuck (in C code) past the cancel
  grace period (restarted, its other callers told why), a worker killed with kill -9 mid-call (callers get
  :worker_exit, capacity comes back), and a stopped pool leaving no Python process.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Pool, Worker}
  alias VllmBridge.Pool.Slots

  # One worker, two calls in flight at most, two waiters at most.
  @pool :rt_q

  setup_all do
    start_pool!(@pool,
      size: 1,
      max_in_flight: 2,
      queue_size: 2,
      cancel_grace: 1_500,
      allow: ["vllm_bridge.bridge.diag", "cancel_support"],
      worker_env: [python_path([python_support_dir()])]
    )

    :ok
  end

  setup do
    # Every test starts from a serving, idle pool.
    {[%{instance: instance}], meta} = await_idle!(@pool)
    %{meta: meta, instance: instance}
  end

  defp call(fun, args, opts \\ []),
    do: VllmBridge.call({"vllm_bridge.bridge.diag", fun}, args, %{}, [pool_name: @pool] ++ opts)

  test "a full queue answers :queue_full at once; the waiters are then served", %{meta: meta} do
    holds = [hold(pool_name: @pool), hold(pool_name: @pool)]
    assert Slots.load(meta, 0) == 2

    waiters = for n <- 1..2, do: Task.async(fn -> call("add", [n, 10]) end)
    wait_until(fn -> Slots.waiting(meta) == 2 end)

    assert {:error, %Error{type: :queue_full, message: msg}} = call("add", [0, 0])
    assert msg =~ "queue_size"

    Enum.each(holds, &unhold/1)
    assert Enum.map(waiters, &Task.await/1) == [{:ok, 11}, {:ok, 12}]
  end

  test "the deadline covers time spent queued", %{meta: meta} do
    holds = [hold(pool_name: @pool), hold(pool_name: @pool)]

    assert {:error, %Error{type: :timeout, message: msg}} = call("add", [1, 1], timeout: 150)
    assert msg =~ "queued"
    assert Slots.waiting(meta) == 0

    Enum.each(holds, &unhold/1)
    assert {:ok, 2} = call("add", [1, 1])
  end

  test "a timed-out call: :timeout on time, late reply dropped, worker kept", %{instance: inst} do
    assert {:error, %Error{type: :timeout}} = call("sleep", [0.4], timeout: 50)
    # The Python call finishes well inside the grace period; nothing reaches us.
    [%{pid: w}] = workers!(@pool)
    wait_until(fn -> match?({:ok, %{"running" => nil}}, Worker.ping(w)) end)
    wait_until(fn -> Worker.in_flight(w) == 0 end)
    refute_received _
    assert [%{instance: ^inst}] = workers!(@pool)
    assert {:ok, 3} = call("add", [1, 2])
  end

  test "a call still running after the grace period restarts the worker", %{instance: inst} do
    parent = self()

    # Stuck in C: the cancel cannot interrupt it (a Python loop or sleep it would).
    stuck =
      Task.async(fn ->
        send(parent, :stuck_sent)
        VllmBridge.call({"cancel_support", "stuck"}, [60], %{}, pool_name: @pool, timeout: 200)
      end)

    assert_receive :stuck_sent
    [%{pid: w}] = workers!(@pool)
    wait_until(fn -> Worker.in_flight(w) == 1 end)
    # Pipelined behind the stuck call, with a long deadline of its own.
    behind = Task.async(fn -> call("add", [1, 1], timeout: 60_000) end)

    assert {:error, %Error{type: :timeout}} = Task.await(stuck)
    assert {:error, %Error{type: :worker_exit, message: why}} = Task.await(behind, 30_000)
    assert why =~ "still running" and why =~ "cancel_grace 1500 ms"

    [%{instance: new}] = workers!(@pool)
    assert new != inst
    assert {:ok, 2} = call("add", [1, 1])
  end

  test "kill -9 mid-call: the callers get :worker_exit, the pool serves again", %{meta: meta} do
    [%{os_pid: os_pid, instance: inst, pid: w}] = workers!(@pool)
    tasks = for _ <- 1..2, do: Task.async(fn -> call("sleep", [60], timeout: 60_000) end)
    wait_until(fn -> Worker.in_flight(w) == 2 end)

    System.cmd("kill", ["-9", "#{os_pid}"])

    for t <- tasks, do: assert({:error, %Error{type: :worker_exit}} = Task.await(t, 30_000))
    refute os_alive?(os_pid)

    [%{instance: new, os_pid: new_os_pid}] = workers!(@pool)
    assert new != inst and new_os_pid != os_pid
    # Full capacity is back: two calls in flight at once again, and the queue is empty.
    assert Slots.load(meta, 0) == 0
    holds = [hold(pool_name: @pool), hold(pool_name: @pool)]
    assert Slots.load(meta, 0) == 2
    Enum.each(holds, &unhold/1)
    assert {:ok, 4} = call("add", [2, 2])
  end

  test "stopping a pool leaves no Python process" do
    start_pool!(:rt_stop, size: 2)
    os_pids = for w <- workers!(:rt_stop), do: w.os_pid
    assert Enum.all?(os_pids, &os_alive?/1)

    # One of them busy in a call when the pool stops.
    busy =
      Task.async(fn ->
        VllmBridge.call({"vllm_bridge.bridge.diag", "sleep"}, [60], %{}, pool_name: :rt_stop)
      end)

    wait_until(fn -> Enum.any?(workers!(:rt_stop), &(&1.load == 1)) end)

    assert :ok = VllmBridge.stop_pool(:rt_stop)
    assert {:error, %Error{type: :worker_exit}} = Task.await(busy)
    refute Enum.any?(os_pids, &os_alive?/1)
    refute :rt_stop in Pool.names()
  end
end
