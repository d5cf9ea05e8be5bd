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

  # The worker monitors a caller once, not once per call (VllmBridge.Worker.Calls): the
  # monitor holds every live call of its caller, and goes at the sweep after its last.
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

  test "an idle caller's monitor goes at a sweep; its next call is monitored again",
       %{w: w, meta: meta, instance: instance} do
    me = self()

    caller =
      spawn(fn ->
        {:ok, 2} = diag("add", [1, 1])
        send(me, :first_done)
        receive do: (:go -> diag("sleep", [60], timeout: :infinity))
      end)

    assert_receive :first_done, 30_000
    # Idle (no call in flight): let go at a sweep, however many calls it made before.
    wait_until(fn -> not monitored?(w, caller) end, @prompt, "the idle caller let go")

    send(caller, :go)
    wait_until(fn -> running?(w) end)
    assert monitored?(w, caller)
    Process.exit(caller, :kill)

    # Long before the sleep's 60 s: the call was cancelled by the new monitor.
    wait_until(fn -> worker_idle?(w, meta) end, @prompt, "the call cancelled")
    assert [%{instance: ^instance}] = workers!(@pool)
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
