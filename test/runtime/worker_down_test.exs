defmodule VllmBridge.Runtime.WorkerDownTest do
  @moduledoc """
  A worker that goes down says why to every caller that loses it: the calls in flight;
  the requests still in its mailbox when it stopped (they see its stop reason); and a
  caller that retries at once, which finds the worker gone from the directory, its slots
  down and its reason recorded (its session lost, saying why), never a half-dead worker
  that answers with a generic message.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Session, Worker}
  alias VllmBridge.Pool.{Directory, Slots}

  @pool :rt_worker_down

  test "requests still in the mailbox of a worker that stops get its reason" do
    Process.flag(:trap_exit, true)
    {:ok, w} = Worker.start_link()
    {:ok, %{"pid" => os_pid}} = Worker.await_ready(w)

    # The exit of its Python process first in the worker's mailbox, then three requests.
    :ok = :sys.suspend(w)
    System.cmd("kill", ["-KILL", "#{os_pid}"])

    wait_until(fn ->
      match?({:message_queue_len, n} when n >= 1, Process.info(w, :message_queue_len))
    end)

    calls =
      for i <- 1..3 do
        Task.async(fn -> Worker.call(w, "vllm_bridge.bridge.diag", "add", [i, 1], %{}, 60_000) end)
      end

    wait_until(fn ->
      match?({:message_queue_len, n} when n >= 4, Process.info(w, :message_queue_len))
    end)

    :ok = :sys.resume(w)

    for call <- calls do
      assert {:error, %Error{type: :worker_exit, message: msg}} = Task.await(call, 30_000)
      assert msg =~ "the Python worker exited with status"
    end

    assert_receive {:EXIT, ^w, {:shutdown, {:worker_exit, "the Python worker exited" <> _}}}
  end

  test "the worker goes down in the directory and its slots before any caller hears of it" do
    start_pool!(@pool, size: 1)
    [%{pid: w, os_pid: os_pid, instance: instance}] = workers!(@pool)

    call =
      Task.async(fn ->
        VllmBridge.call({"vllm_bridge.bridge.diag", "sleep"}, [60], %{}, pool_name: @pool)
      end)

    wait_until(fn -> running?(w) end)

    # What the worker does, in its order: its calls of the directory and the slots, the
    # ETS writes they make, and what it sends.
    patterns = [
      {Directory, :worker_down, 4},
      {Slots, :put_load, 3},
      {:ets, :insert, 2},
      {:ets, :delete, 2},
      {:ets, :match_delete, 2}
    ]

    on_exit(fn -> for p <- patterns, do: :erlang.trace_pattern(p, false, [:global]) end)
    for p <- patterns, do: :erlang.trace_pattern(p, true, [:global])
    mon = Process.monitor(w)
    :erlang.trace(w, true, [:call, :send])
    System.cmd("kill", ["-KILL", "#{os_pid}"])

    assert {:error, %Error{type: :worker_exit, message: why}} = Task.await(call, 30_000)
    events = collect(w, mon, [])

    told = Enum.find_index(events, &match?({:send, {_, :worker_exit, ^why}}, &1))
    down = Enum.find_index(events, &match?({:call, {Directory, :worker_down, _}}, &1))

    slots =
      Enum.find_index(events, &match?({:call, {Slots, :put_load, [_, 0, n]}} when n > 0, &1))

    reason =
      Enum.find_index(
        events,
        &match?({:call, {:ets, :insert, [_, {{:down, @pool, 0}, ^instance, ^why}]}}, &1)
      )

    row =
      Enum.find_index(
        events,
        &match?({:call, {:ets, :match_delete, [_, {{:worker, @pool, 0}, _, _}]}}, &1)
      )

    assert told && down && slots && reason && row, inspect(events, limit: 50)
    assert down < told and slots < told
    # The reason is there before the row goes: a reader never finds neither.
    assert reason < row
  end

  # The trace of worker `w` until it is gone (a process's trace messages come before its
  # :DOWN).
  defp collect(w, mon, acc) do
    receive do
      {:trace, ^w, :call, {m, f, args}} -> collect(w, mon, [{:call, {m, f, args}} | acc])
      {:trace, ^w, :send, msg, _to} -> collect(w, mon, [{:send, msg} | acc])
      {:DOWN, ^mon, :process, ^w, _} -> Enum.reverse(acc)
    end
  end

  test "a stream that does not stop within cancel_grace: the kill names its target" do
    start_pool!(@pool,
      size: 1,
      cancel_grace: 500,
      allow: ["vllm_bridge.bridge.diag", "rt_stream_support"],
      worker_env: [
        {"PYTHONPATH", Enum.join([support_dir() | List.wrap(System.get_env("PYTHONPATH"))], ":")}
      ]
    )

    {:ok, session} = Session.open(pool_name: @pool)

    {:ok, s} =
      VllmBridge.stream({"rt_stream_support", "stubborn"}, [60], %{},
        session_id: session.id,
        timeout: 300
      )

    assert %Error{type: :timeout} = catch_error(Enum.to_list(s))

    # The session's next call loses the worker (queued behind the stream that does not
    # stop), or finds it lost already: either way it says why, naming the stream.
    assert {:error, %Error{type: type, message: why}} =
             VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [1, 1], %{},
               session_id: session.id,
               timeout: 60_000
             )

    assert type in [:worker_exit, :session_lost]
    assert why =~ "was killed because request"
    assert why =~ ~s[(stream {"rt_stream_support", "stubborn"}) was still running]
  end

  test "a caller told of the worker's end finds it gone, its slots down and its reason kept" do
    start_pool!(@pool, size: 1)
    [%{pid: w, os_pid: os_pid, instance: instance}] = workers!(@pool)
    {:ok, meta} = VllmBridge.Pool.meta(@pool)
    {:ok, s} = Session.open(pool_name: @pool)
    me = self()

    # Everything it checks, it checks the moment its call returns.
    caller =
      Task.async(fn ->
        send(me, :calling)

        result =
          VllmBridge.call({"vllm_bridge.bridge.diag", "sleep"}, [60], %{}, session_id: s.id)

        seen = {Directory.worker(@pool, 0), Slots.load(meta, 0)}

        retry =
          VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [1, 1], %{},
            session_id: s.id,
            affinity: :strict_fail_fast
          )

        {result, seen, Directory.down_reason(@pool, 0, instance), retry}
      end)

    assert_receive :calling
    wait_until(fn -> running?(w) end)
    System.cmd("kill", ["-KILL", "#{os_pid}"])

    assert {{:error, %Error{type: :worker_exit, message: why}}, {row, load}, reason, retry} =
             Task.await(caller, 30_000)

    assert why =~ "the Python worker exited with status"
    assert row == nil or elem(row, 0) != w
    assert load >= div(Slots.down(), 2)
    assert reason == why
    assert {:error, %Error{type: :session_lost, message: lost}} = retry
    assert lost =~ why
  end
end
