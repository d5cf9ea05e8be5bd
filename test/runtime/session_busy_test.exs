defmodule VllmBridge.Runtime.SessionBusyTest do
  @moduledoc """
  Busy means busy, with the default `max_in_flight` (16): a worker running one call, or
  holding one, is busy. `:strict_fail_fast` is `:pool_busy` at once; `:hint` moves a
  state-free call to an idle worker and stays home when home is idle or every worker is
  as busy. A long call is `rt_gate.wait_for/1`, which runs until the test creates its
  file, so what is asserted is the order of events, never how long anything took.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Error
  alias VllmBridge.Pool.Slots
  alias VllmBridge.Session

  @pool :rt_busy

  setup_all do
    dir = Path.join(System.tmp_dir!(), "rt_gate_#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    # Registered before the pool's, so it runs after the pool has stopped.
    on_exit(fn -> File.rm_rf!(dir) end)

    start_pool!(@pool,
      size: 2,
      allow: ["vllm_bridge.bridge.diag", "rt_gate"],
      worker_env: [
        {"PYTHONPATH", Enum.join([support_dir() | List.wrap(System.get_env("PYTHONPATH"))], ":")}
      ]
    )

    %{dir: dir}
  end

  setup %{dir: dir} do
    {ws, meta} = await_idle!(@pool)
    assert meta.max_in_flight == 16
    %{ws: ws, meta: meta, dir: dir}
  end

  defp diag(fun, args, opts),
    do: VllmBridge.call({"vllm_bridge.bridge.diag", fun}, args, %{}, [pool_name: @pool] ++ opts)

  defp open!(opts) do
    {:ok, s} = Session.open([pool_name: @pool] ++ opts)
    on_exit(fn -> Session.close(s) end)
    s
  end

  # A gate: a file path that does not exist yet; opened (created) at the latest when the
  # test ends, so that a failed test does not leave a worker busy.
  defp gate!(dir) do
    path = Path.join(dir, "gate_#{System.unique_integer([:positive])}")
    on_exit(fn -> File.touch(path) end)
    path
  end

  defp open_gate(path), do: File.touch!(path)

  # A call that runs on the session's worker until its gate opens; returns once the
  # worker's Python side runs it.
  defp long!(gate, session, w) do
    task =
      Task.async(fn ->
        VllmBridge.call({"rt_gate", "wait_for"}, [gate], %{},
          pool_name: @pool,
          session_id: session.id
        )
      end)

    wait_until(fn -> running?(w.pid) end, 30_000, "the long call running")
    task
  end

  describe ":strict_fail_fast" do
    test "is :pool_busy while the session's worker runs a long call, which goes on running",
         %{ws: [w0, _], meta: meta, dir: dir} do
      s = open!(worker: 0)
      {:ok, ref} = diag("opaque", [1], session_id: s.id)
      gate = gate!(dir)
      long = long!(gate, s, w0)

      assert {:error, %Error{type: :pool_busy, message: msg}} =
               diag("add", [1, 2], session_id: s.id, affinity: :strict_fail_fast)

      assert msg =~ "worker 0" and msg =~ "busy with 1 call(s)" and msg =~ ":strict_fail_fast"

      # Bound to a reference of the session: the same.
      assert {:error, %Error{type: :pool_busy}} =
               VllmBridge.call({ref, "bump"}, [], %{}, affinity: :strict_fail_fast)

      # It answered while the long call still runs; nothing was queued or left reserved.
      assert Task.yield(long, 0) == nil
      assert running?(w0.pid)
      assert Slots.load(meta, 0) == 1 and Slots.waiting(meta) == 0

      open_gate(gate)
      assert {:ok, pid} = Task.await(long, 30_000)
      assert pid == w0.os_pid
      # Idle again: fail-fast calls run, back to back (each finds the slot of the one
      # before already given back).
      for i <- 1..50 do
        assert {:ok, ^i} = diag("add", [i, 0], session_id: s.id, affinity: :strict_fail_fast)
      end

      assert {:ok, 2} = VllmBridge.call({ref, "bump"}, [], %{}, affinity: :strict_fail_fast)
    end

    test "is :pool_busy while a call is queued behind the running one, naming the count",
         %{ws: [w0, _], dir: dir} do
      s = open!(worker: 0)
      gate = gate!(dir)
      long = long!(gate, s, w0)
      # A :strict_queue call of another session is pipelined behind it (room for 16).
      other = open!(worker: 0)
      queued = Task.async(fn -> diag("add", [2, 2], session_id: other.id) end)
      wait_until(fn -> match?({:ok, %{"queued" => 1}}, VllmBridge.Worker.ping(w0.pid)) end)

      assert {:error, %Error{type: :pool_busy, message: msg}} =
               diag("add", [1, 2], session_id: s.id, affinity: :strict_fail_fast)

      assert msg =~ "busy with 2 call(s)"
      assert Task.yield(long, 0) == nil and Task.yield(queued, 0) == nil

      open_gate(gate)
      assert {:ok, _} = Task.await(long, 30_000)
      assert {:ok, 4} = Task.await(queued, 30_000)
    end

    test "is :pool_busy while a call holds the worker's slot before Python runs it",
         %{ws: [w0, _], meta: meta} do
      s = open!(worker: 0)
      # A caller that has reserved its slot and not yet sent its request: Python runs
      # nothing, but the worker holds a call.
      assert Slots.reserve(meta, 0)
      assert {:ok, %{"running" => nil, "queued" => 0}} = VllmBridge.Worker.ping(w0.pid)

      assert {:error, %Error{type: :pool_busy, message: msg}} =
               diag("add", [1, 2], session_id: s.id, affinity: :strict_fail_fast)

      assert msg =~ "busy with 1 call(s)"
      Slots.release(meta, 0)
      assert {:ok, 3} = diag("add", [1, 2], session_id: s.id, affinity: :strict_fail_fast)
    end

    test "a count the sweep left below zero still reads as idle, and the sweep sets it right",
         %{ws: [w0, _], meta: meta} do
      s = open!(worker: 0)
      # A slot reserved and never used (a caller that died before sending): the sweep
      # gives it back, once it has seen it unchanged with nothing arriving.
      assert Slots.reserve(meta, 0)
      wait_until(fn -> Slots.load(meta, 0) == 0 end, 30_000, "the leftover slot given back")

      # Had that caller's request come after all, its reply takes the count below zero.
      req =
        VllmBridge.Call.Request.new("call",
          pre: [VllmBridge.Call.Wire.value(nil)],
          post: [
            VllmBridge.Call.Wire.value(["m", "vllm_bridge.bridge.diag", "add"]),
            VllmBridge.Call.Wire.value([1, 1]),
            VllmBridge.Call.Wire.value(%{})
          ]
        )

      deadline = System.monotonic_time(:millisecond) + 30_000
      assert {:ok, 2} = VllmBridge.Call.Request.call(w0.pid, req, deadline, holds_slot: true)
      assert Slots.load(meta, 0) in [-1, 0]

      # The worker is idle: a fail-fast call runs, and gives its slot back.
      assert {:ok, 3} = diag("add", [1, 2], session_id: s.id, affinity: :strict_fail_fast)
      wait_until(fn -> Slots.load(meta, 0) == 0 end, 30_000, "the count set right")
      assert {:ok, 7} = diag("add", [3, 4], session_id: s.id, affinity: :strict_fail_fast)
    end

    test "says so when the session's worker is restarting", %{meta: meta} do
      s = open!(worker: 1)
      # What a worker that is not serving holds (VllmBridge.Worker sets it while it starts).
      Slots.put_load(meta, 1, Slots.down())

      try do
        assert {:error, %Error{type: :pool_busy, message: msg}} =
                 diag("add", [1, 2], session_id: s.id, affinity: :strict_fail_fast)

        assert msg =~ "worker 1" and msg =~ "restarting"
      after
        Slots.put_load(meta, 1, 0)
      end
    end
  end

  describe ":hint" do
    test "moves a state-free call to the idle worker while home runs a long call",
         %{ws: [w0, w1], meta: meta, dir: dir} do
      s = open!(worker: 0)
      gate = gate!(dir)
      long = long!(gate, s, w0)
      away = w1.os_pid

      assert {:ok, %{"pid" => ^away}} = diag("info", [], session_id: s.id, affinity: :hint)
      assert Task.yield(long, 0) == nil
      assert Slots.load(meta, 0) == 1

      open_gate(gate)
      assert {:ok, _} = Task.await(long, 30_000)
    end

    test "stays home when the session's worker is idle, the other worker busy or not",
         %{ws: [w0, w1], meta: meta, dir: dir} do
      home = w0.os_pid
      s = open!(worker: 0)
      s1 = open!(worker: 1)

      # Both idle: home wins, for either session.
      for _ <- 1..20 do
        assert {:ok, %{"pid" => ^home}} = diag("info", [], session_id: s.id, affinity: :hint)
      end

      away = w1.os_pid
      assert {:ok, %{"pid" => ^away}} = diag("info", [], session_id: s1.id, affinity: :hint)

      # The other worker busy (a long call of its own session): an idle home still wins.
      gate = gate!(dir)
      long = long!(gate, s1, w1)

      for _ <- 1..20 do
        assert {:ok, %{"pid" => ^home}} = diag("info", [], session_id: s.id, affinity: :hint)
      end

      assert Task.yield(long, 0) == nil and Slots.load(meta, 1) == 1
      open_gate(gate)
      assert {:ok, _} = Task.await(long, 30_000)
    end

    test "stays home when every worker is as busy (ties go home); a call with a reference stays",
         %{ws: [w0, w1], meta: meta, dir: dir} do
      s = open!(worker: 0)
      {:ok, ref} = diag("opaque", [5], session_id: s.id)
      s1 = open!(worker: 1)
      gate0 = gate!(dir)
      gate1 = gate!(dir)
      long0 = long!(gate0, s, w0)
      long1 = long!(gate1, s1, w1)
      assert Slots.load(meta, 0) == 1 and Slots.load(meta, 1) == 1

      tie = Task.async(fn -> diag("info", [], session_id: s.id, affinity: :hint) end)
      wait_until(fn -> Slots.load(meta, 0) == 2 end)
      assert Slots.load(meta, 1) == 1

      # Worker 1 is now the less loaded, but a call on a reference stays home.
      with_ref =
        Task.async(fn ->
          VllmBridge.call({ref, "bump"}, [], %{}, session_id: s.id, affinity: :hint)
        end)

      wait_until(fn -> Slots.load(meta, 0) == 3 end)
      assert Slots.load(meta, 1) == 1
      assert Task.yield(tie, 0) == nil and Task.yield(with_ref, 0) == nil

      home = w0.os_pid
      open_gate(gate0)
      assert {:ok, %{"pid" => ^home}} = Task.await(tie, 30_000)
      assert {:ok, 6} = Task.await(with_ref, 30_000)
      open_gate(gate1)
      assert {:ok, _} = Task.await(long0, 30_000)
      assert {:ok, _} = Task.await(long1, 30_000)
    end
  end
end
