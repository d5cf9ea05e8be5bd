defmodule VllmBridge.Runtime.CallerExitTest do
  @moduledoc """
  A caller that dies with a request in flight: the worker notices at once (not at the
  request's deadline) and cancels it, as a timeout would. Its stream is cancelled, its
  queued call dropped and its running call interrupted, so the slot comes back, without
  the worker being restarted for it.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Pool, Worker}
  alias VllmBridge.Pool.Slots
  alias VllmBridge.Call.{Request, Wire}

  # A short cancel grace: a worker restarted for a dead caller's call would show.
  @pool :rt_caller

  setup_all do
    start_pool!(@pool, size: 1, max_in_flight: 4, cancel_grace: 300)
    :ok
  end

  setup do
    [%{pid: w, instance: instance}] = workers!(@pool)
    {:ok, meta} = Pool.meta(@pool)
    wait_until(fn -> worker_idle?(w, meta) end)
    {:ok, _} = diag("exit_log", [true])
    %{w: w, meta: meta, instance: instance}
  end

  defp diag(fun, args, opts \\ []),
    do: VllmBridge.call({"vllm_bridge.bridge.diag", fun}, args, %{}, [pool_name: @pool] ++ opts)

  # Less than the 30 minutes of stream_timeout or :infinity, more than a busy machine needs.
  @prompt 15_000

  test "a stream whose consumer dies is cancelled; the slot comes back", %{w: w, meta: meta} do
    me = self()

    consumer =
      spawn(fn ->
        {:ok, s} =
          VllmBridge.stream(
            {"vllm_bridge.bridge.diag", "count"},
            [1_000_000, 0.01, "orphan"],
            %{},
            pool_name: @pool,
            timeout_profile: :streaming
          )

        Enum.each(s, &send(me, {:chunk, &1}))
      end)

    assert_receive {:chunk, 2}, 30_000
    Process.exit(consumer, :kill)

    wait_until(fn -> worker_idle?(w, meta) end, @prompt, "the orphaned stream cancelled")

    # Stopped, not run to its end: interrupted inside a chunk, or closed between two.
    assert {:ok, [%{"name" => "orphan", "type" => type}]} = diag("exit_log", [])

    assert type in [
             "vllm_bridge.bridge.protocol.errors.CallInterrupted",
             "builtins.GeneratorExit"
           ]
  end

  test "a queued call whose caller dies is dropped before it runs",
       %{w: w, meta: meta, instance: instance} do
    # A live caller keeps the Python worker busy (a stream, until unhold) ...
    first = hold(pool_name: @pool)
    wait_until(fn -> running?(w) end)

    # ... while a dead one's long call waits behind it in the worker's queue.
    caller = spawn(fn -> diag("sleep", [60], timeout: :infinity) end)
    wait_until(fn -> match?({:ok, %{"queued" => 1}}, Worker.ping(w)) end)
    Process.exit(caller, :kill)

    # Dropped from the queue while the stream still runs.
    wait_until(fn -> match?({:ok, %{"queued" => 0}}, Worker.ping(w)) end, @prompt)
    assert running?(w)
    wait_until(fn -> Slots.load(meta, 0) == 1 end)
    unhold(first)
    wait_until(fn -> worker_idle?(w, meta) end, @prompt, "the dead caller's call dropped")
    assert [%{instance: ^instance}] = workers!(@pool)
  end

  test "a running call whose caller dies is interrupted; the worker is not restarted",
       %{w: w, meta: meta, instance: instance} do
    caller = spawn(fn -> diag("sleep", [60], timeout: :infinity) end)
    wait_until(fn -> running?(w) end)
    Process.exit(caller, :kill)

    # Long before the sleep's 60 s: it was interrupted.
    wait_until(fn -> worker_idle?(w, meta) end, @prompt)
    assert [%{instance: ^instance}] = workers!(@pool)
    assert {:ok, 2} = diag("add", [1, 1])
  end

  test "callers that die in numbers leave the pool idle and serving", %{w: w, meta: meta} do
    callers =
      for i <- 1..20 do
        spawn(fn ->
          if rem(i, 2) == 0,
            do: diag("sleep", [0.05], timeout: :infinity),
            else:
              Enum.to_list(
                elem(
                  VllmBridge.stream({"vllm_bridge.bridge.diag", "count"}, [1_000, 0.01], %{},
                    pool_name: @pool
                  ),
                  1
                )
              )
        end)
      end

    wait_until(fn -> Worker.in_flight(w) > 0 end)
    Enum.each(callers, &Process.exit(&1, :kill))

    wait_until(fn -> worker_idle?(w, meta) end, @prompt)
    assert Slots.waiting(meta) == 0
    assert {:ok, 5} = diag("add", [2, 3])
  end

  # The worker monitors a caller once while it calls (VllmBridge.Worker.Calls): the
  # monitor holds every live call of its caller; it goes when a caller's first call ends,
  # and at the sweep after its last for a caller that called again.
  defp monitored?(w, pid), do: Map.has_key?(:sys.get_state(w).calls.callers, pid)

  test "a caller with two calls in flight that dies has both cancelled", %{w: w, meta: meta} do
    me = self()
    target = {"vllm_bridge.bridge.diag", "sleep"}
    {:ok, parts} = Wire.encode_invoke(target, [60], %{})
    req = Request.new("call", pre: [Wire.value(nil)], post: parts, target: target)

    # Two requests sent straight to the worker process by one caller (a pool's caller
    # has one at a time; a process may hold more through Request.send_request/4).
    caller =
      spawn(fn ->
        Request.send_request(w, req, :infinity)
        Request.send_request(w, req, :infinity)
        send(me, :sent)
        Process.sleep(:infinity)
      end)

    assert_receive :sent, 30_000
    wait_until(fn -> Worker.in_flight(w) == 2 and running?(w) end)
    assert monitored?(w, caller)
    Process.exit(caller, :kill)

    wait_until(
      fn -> worker_idle?(w, meta) end,
      @prompt,
      "both calls of the dead caller cancelled"
    )

    refute monitored?(w, caller)
    assert {:ok, 3} = diag("add", [1, 2])
  end

  test "a caller that calls again keeps its monitor until a sweep; then monitored anew",
       %{w: w, meta: meta, instance: instance} do
    me = self()

    caller =
      spawn(fn ->
        Stream.repeatedly(fn ->
          receive do
            {:add, i} -> send(me, {:added, diag("add", [i, 1])})
            :go -> diag("sleep", [60], timeout: :infinity)
          end
        end)
        |> Stream.run()
      end)

    add = fn i ->
      send(caller, {:add, i})
      assert_receive {:added, {:ok, sum}}, 30_000
      assert sum == i + 1
    end

    # Its first call's monitor goes when that call ends (the worker answered it before
    # it reads this :sys.get_state).
    add.(1)
    refute monitored?(w, caller)

    # A caller that calls again keeps its monitor while idle. Seen after some call but
    # the first: a sweep between its last two calls (once a second) forgets it once.
    assert Enum.any?(2..6, fn i ->
             add.(i)
             monitored?(w, caller)
           end)

    # Let go at a sweep, however many calls it made before.
    wait_until(fn -> not monitored?(w, caller) end, @prompt, "the idle caller let go")

    send(caller, :go)
    wait_until(fn -> running?(w) end)
    assert monitored?(w, caller)
    Process.exit(caller, :kill)

    # Long before the sleep's 60 s: the call was cancelled by the new monitor.
    wait_until(fn -> worker_idle?(w, meta) end, @prompt, "the call cancelled")
    assert [%{instance: ^instance}] = workers!(@pool)
  end

  test "callers of one call each are let go as their call ends: no :DOWN reaches the worker",
       %{w: w, meta: meta} do
    # The worker's mailbox, traced: every :DOWN it receives comes here.
    :erlang.trace(w, true, [:receive, {:tracer, self()}])

    tasks =
      for i <- 1..20 do
        task = Task.async(fn -> diag("add", [i, 1]) end)
        assert {:ok, i + 1} == Task.await(task, 30_000)
        # Answered, so no longer monitored (the worker let it go before it could read
        # this :sys.get_state), though the task may not have exited yet.
        refute monitored?(w, task.pid)
        task.pid
      end

    # Every task gone (Task.await saw its reply; wait for its exit), then the worker
    # synchronised with: a :DOWN for any of them would have been received by now.
    for pid <- tasks do
      ref = Process.monitor(pid)
      assert_receive {:DOWN, ^ref, :process, ^pid, _}, 30_000
    end

    _ = :sys.get_state(w)
    :erlang.trace(w, false, [:receive])
    received = traced(w, [])
    assert Enum.any?(received, &match?({:system, _, _}, &1)), "the trace saw the worker"

    for pid <- tasks do
      refute Enum.any?(received, &match?({:DOWN, _, :process, ^pid, _}, &1))
    end

    assert worker_idle?(w, meta)

    # A caller of one call that dies while its call runs still has it cancelled.
    caller = spawn(fn -> diag("sleep", [60], timeout: :infinity) end)
    wait_until(fn -> running?(w) end)
    assert monitored?(w, caller)
    Process.exit(caller, :kill)
    wait_until(fn -> worker_idle?(w, meta) end, @prompt, "the dead task's call cancelled")
  end

  # The messages the worker received while traced, as far as they came here.
  defp traced(w, acc) do
    receive do
      {:trace, ^w, :receive, message} -> traced(w, [message | acc])
    after
      0 -> acc
    end
  end

  test "callers that die between calls leave nothing to cancel", %{w: w, meta: meta} do
    me = self()

    callers =
      for i <- 1..10 do
        spawn(fn ->
          {:ok, _} = diag("add", [i, 1])
          send(me, {:done, self()})
          Process.sleep(:infinity)
        end)
      end

    for c <- callers, do: assert_receive({:done, ^c}, 30_000)
    Enum.each(callers, &Process.exit(&1, :kill))

    wait_until(fn -> Enum.all?(callers, &(not monitored?(w, &1))) end, @prompt, "monitors gone")
    assert worker_idle?(w, meta)
    assert {:ok, 7} = diag("add", [3, 4])
  end
end
