Code.require_file("../support/telemetry_helpers.exs", __DIR__)

defmodule VllmBridge.Runtime.TelemetryTest do
  @moduledoc """
  The telemetry events of VllmBridge.Telemetry's table, as an app with `:telemetry`
  receives them (through the stand-in of test/support/telemetry_stand_in.exs), from real
  workers: the `[:vllm_bridge, :call]` span of every request kind, for a success, a
  Python exception, a timeout, a worker that dies under a call, a request refused before
  it has a route and a full queue; the worker's start, exit and stop; the pool's
  `queue_full`. Each test has its pool of its own, and records only that pool's events.

  Not async: the stand-in is loaded in `setup_all`, after the async tests ran without
  it (so the path without `:telemetry` is what they test).
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers
  import VllmBridge.TelemetryHelpers

  alias VllmBridge.Error

  # The stand-in :telemetry is loaded at run time (setup_all).
  @compile {:no_warn_undefined, :telemetry}

  @call [:vllm_bridge, :call]
  @diag "vllm_bridge.bridge.diag"

  setup_all do
    load!()
  end

  describe "the call span" do
    setup do
      pool = start_pool!(:tel_calls, size: 1)
      await_idle!(pool)
      record(pool, call_events())
      %{pool: pool}
    end

    test "a success: start and stop, pool, worker, target, kind, sizes", %{pool: pool} do
      assert {:ok, 3} = VllmBridge.call({@diag, "add"}, [1, 2], %{}, pool_name: pool)

      {start_m, start_md, :stop, stop_m, stop_md} = next_span(@call)

      assert start_md == %{
               pool: pool,
               request_kind: :call,
               target: {@diag, "add"},
               session_id: nil,
               telemetry_span_context: start_md.telemetry_span_context
             }

      assert start_m.system_time <= System.system_time()
      assert %{worker: 0, error: nil, python_type: nil, error_message: nil} = stop_md
      assert is_integer(stop_m.queue_time) and stop_m.queue_time >= 0
      assert stop_m.queue_time <= stop_m.duration
      # The request's encoded fields: session, target, args and kwargs; the reply frame.
      assert stop_m.request_bytes > byte_size(@diag <> "add")
      assert stop_m.reply_bytes > 0
      refute_event(@call ++ [:exception])
    end

    test "the sizes follow what travels: a large argument, a large reply", %{pool: pool} do
      small = String.duplicate("x", 10)
      big = String.duplicate("x", 100_000)

      assert {:ok, ^small} = VllmBridge.call({@diag, "echo"}, [small], %{}, pool_name: pool)
      {_, _, :stop, small_m, _} = next_span(@call)
      assert {:ok, ^big} = VllmBridge.call({@diag, "echo"}, [big], %{}, pool_name: pool)
      {_, _, :stop, big_m, _} = next_span(@call)

      assert big_m.request_bytes - small_m.request_bytes >= 100_000 - 10
      assert big_m.reply_bytes - small_m.reply_bytes >= 100_000 - 10
    end

    test "a Python exception is a :stop whose metadata names the error", %{pool: pool} do
      assert {:error, %Error{type: :python_exception}} =
               VllmBridge.call({@diag, "fail"}, ["boom", "KeyError"], %{}, pool_name: pool)

      {_, _, :stop, stop_m, stop_md} = next_span(@call)

      assert %{error: :python_exception, python_type: "KeyError", worker: 0} = stop_md
      assert stop_md.error_message =~ "boom"
      # The error came back in a reply frame.
      assert stop_m.reply_bytes > 0
    end

    test "a timeout is a :stop with error :timeout and no reply", %{pool: pool} do
      assert {:error, %Error{type: :timeout}} =
               VllmBridge.call({@diag, "sleep"}, [30], %{}, pool_name: pool, timeout: 200)

      {_, _, :stop, stop_m, stop_md} = next_span(@call)
      assert %{error: :timeout, python_type: nil, worker: 0} = stop_md
      assert stop_md.error_message =~ "timeout 200 ms"
      assert stop_m.reply_bytes == 0
    end

    test "get, enter and exit: their own kinds, in the session", %{pool: pool} do
      assert {:ok, false} =
               VllmBridge.get({"vllm_bridge.forward_context", "track_batchsize"}, pool_name: pool)

      {_, %{request_kind: :get, session_id: nil}, :stop, _, %{error: nil}} = next_span(@call)

      {:ok, s} = VllmBridge.Session.open(pool_name: pool)
      on_exit(fn -> VllmBridge.Session.close(s) end)

      assert {:ok, {handle, _}} =
               VllmBridge.enter({@diag, "recorder"}, ["t"], %{}, session_id: s.id)

      {_, enter_md, :stop, _, %{error: nil, worker: 0}} = next_span(@call)
      assert %{request_kind: :enter, session_id: id, target: {@diag, "recorder"}} = enter_md
      assert id == s.id

      assert {:ok, false} = VllmBridge.exit(handle, nil, session_id: s.id)
      {_, exit_md, :stop, _, %{error: nil, worker: 0}} = next_span(@call)
      assert %{request_kind: :exit, session_id: ^id, target: ^handle} = exit_md
    end

    test "a request refused before it has a route still has its span" do
      pool = :tel_not_started
      record(pool, call_events())

      assert {:error, %Error{type: :bad_argument}} =
               VllmBridge.call({@diag, "add"}, [1, 2], %{}, pool_name: pool)

      {_, %{pool: ^pool}, :stop, stop_m, stop_md} = next_span(@call)
      assert %{error: :bad_argument, worker: nil} = stop_md
      assert stop_md.error_message =~ "not started"
      assert %{queue_time: 0, request_bytes: 0, reply_bytes: 0} = stop_m
    end

    test "a stream: one span from the start of its enumeration to its end", %{pool: pool} do
      {:ok, s} = VllmBridge.stream({@diag, "count"}, [3], %{}, pool_name: pool)
      # Nothing is sent (and no span begins) before the enumeration.
      refute_event(@call ++ [:start])
      assert Enum.to_list(s) == [0, 1, 2]

      {_, %{request_kind: :stream, target: {@diag, "count"}}, :stop, stop_m, stop_md} =
        next_span(@call)

      assert %{chunks: 3, halted: false, worker: 0, error: nil} = Map.merge(stop_m, stop_md)
      assert stop_m.reply_bytes > 0 and stop_m.request_bytes > 0
    end

    test "a stream its consumer stops early ends with :stop, halted", %{pool: pool} do
      {:ok, s} = VllmBridge.stream({@diag, "count"}, [1_000, 0.01], %{}, pool_name: pool)
      assert Enum.take(s, 2) == [0, 1]

      {_, _, :stop, stop_m, stop_md} = next_span(@call)
      assert %{chunks: 2, halted: true, error: nil} = Map.merge(stop_m, stop_md)
    end

    test "a stream that raises ends with :exception, the error in its metadata", %{pool: pool} do
      {:ok, s} = VllmBridge.stream({@diag, "fail"}, ["no stream"], %{}, pool_name: pool)
      assert_raise Error, ~r/no stream/, fn -> Enum.to_list(s) end

      {_, _, :exception, ex_m, ex_md} = next_span(@call)

      assert %{kind: :error, reason: %Error{type: :python_exception}, stacktrace: [_ | _]} = ex_md

      assert %{error: :python_exception, python_type: "ValueError", worker: 0} = ex_md
      assert ex_m.chunks == 0
      refute_event(@call ++ [:stop])
      # Nothing of the span is left in the enumerating process.
      assert for({{:vllm_bridge_stream_span_ended, _}, _} <- Process.get(), do: 1) == []
    end

    test "a stream that cannot start (no such pool) ends with :exception too" do
      pool = :tel_no_stream_pool
      record(pool, call_events())
      {:ok, s} = VllmBridge.stream({@diag, "count"}, [3], %{}, pool_name: pool)
      assert_raise Error, ~r/not started/, fn -> Enum.to_list(s) end

      {_, %{pool: ^pool, request_kind: :stream}, :exception, _, ex_md} = next_span(@call)
      assert %{error: :bad_argument, worker: nil, reason: %Error{type: :bad_argument}} = ex_md
      refute_event(@call ++ [:stop])
    end
  end

  describe "call_all" do
    test "a span per worker, overlapping, each with its worker's index" do
      pool = start_pool!(:tel_all, size: 2)
      await_idle!(pool)
      record(pool, call_events())

      assert {:ok, [3, 3]} = VllmBridge.call_all(pool, {@diag, "add"}, [1, 2])

      # Both requests are sent before either reply is awaited: two starts, then two stops.
      {_, s1} = next_event(@call ++ [:start])
      {_, s2} = next_event(@call ++ [:start])
      {_, e1} = next_event(@call ++ [:stop])
      {_, e2} = next_event(@call ++ [:stop])

      assert [s1.telemetry_span_context, s2.telemetry_span_context] ==
               [e1.telemetry_span_context, e2.telemetry_span_context]

      assert [e1.worker, e2.worker] == [0, 1]
      assert Enum.all?([e1, e2], &match?(%{request_kind: :call, error: nil, session_id: nil}, &1))
    end
  end

  describe "span/3" do
    setup do
      test = self()
      id = {:span_test, make_ref()}

      :telemetry.attach_many(
        id,
        for(e <- [:start, :stop, :exception], do: [:tel_test, :work, e]),
        fn event, m, md, _ -> send(test, {:telemetry_event, event, m, md}) end,
        nil
      )

      on_exit(fn -> :telemetry.detach(id) end)
    end

    test "stop: the result returned, extra measurements and the stop metadata" do
      assert :done ==
               VllmBridge.Telemetry.span([:tel_test, :work], %{rank: 1}, fn ->
                 {:done, %{tokens: 8}, %{mode: :eager}}
               end)

      {_, %{rank: 1}, :stop, m, md} = next_span([:tel_test, :work])
      assert %{tokens: 8} = m
      assert %{rank: 1, mode: :eager} = md

      assert 7 == VllmBridge.Telemetry.span([:tel_test, :work], %{}, fn -> {7, %{two: 2}} end)
      {_, _, :stop, _, %{two: 2}} = next_span([:tel_test, :work])
    end

    test "exception: what fun raised, exited with or threw goes on, after the event" do
      for {class, fun} <- [
            error: fn -> raise ArgumentError, "bad" end,
            exit: fn -> exit(:gone) end,
            throw: fn -> throw(:ball) end
          ] do
        caught =
          try do
            VllmBridge.Telemetry.span([:tel_test, :work], %{rank: 2}, fun)
          catch
            k, r -> {k, r}
          end

        {_, _, :exception, _, md} = next_span([:tel_test, :work])
        assert {md.kind, md.reason} == caught
        assert md.kind == class and md.rank == 2 and is_list(md.stacktrace)
      end
    end

    test "a fun that returns neither shape: the span ends with :exception, then it raises" do
      for bad <- [:oops, {1}, {1, :not_a_map}, {1, %{}, :x}, {1, 2, %{}}, {1, %{}, %{}, %{}}] do
        e =
          assert_raise ArgumentError, fn ->
            VllmBridge.Telemetry.span([:tel_test, :work], %{rank: 3}, fn -> bad end)
          end

        assert e.message =~ "got: #{inspect(bad)}"
        {_, _, :exception, _, md} = next_span([:tel_test, :work])
        assert md.kind == :error and md.reason == e and md.rank == 3
      end
    end
  end

  describe "README.md's handler" do
    test "compiles, attaches and logs a failed call and a worker that exits" do
      pool = start_pool!(:tel_readme, size: 1)
      [%{os_pid: os_pid}] = workers!(pool)
      readme = File.read!(Path.expand("../../README.md", __DIR__))
      [_, section] = String.split(readme, "## Observability\n", parts: 2)
      [_, code | _] = String.split(section, ~r/^```(elixir)?\n/m, parts: 3)
      Code.compile_string(code)
      handler = Module.concat([MyApp, BridgeLog])
      :ok = handler.attach()
      on_exit(fn -> :telemetry.detach("my-app-vllm-bridge") end)

      log =
        ExUnit.CaptureLog.capture_log(fn ->
          {:error, _} = VllmBridge.call({@diag, "fail"}, ["x"], %{}, pool_name: pool)
          System.cmd("kill", ["-KILL", "#{os_pid}"])
          wait_until(fn -> hd(workers!(pool)).os_pid != os_pid end)
        end)

      assert log =~ ~s(call {"#{@diag}", "fail"} on :tel_readme worker 0: )
      assert log =~ "error :python_exception"
      assert log =~ "worker 0 of :tel_readme went down: the Python worker exited with status"
    end
  end

  describe "a worker that dies under a call" do
    test "the call's :stop says :worker_exit; the worker's :exit, then its :start again" do
      pool = start_pool!(:tel_crash, size: 1)
      [%{os_pid: os_pid, instance: instance}] = workers!(pool)
      record(pool, call_events() ++ worker_events())

      task = Task.async(fn -> VllmBridge.call({@diag, "sleep"}, [60], %{}, pool_name: pool) end)
      {_, %{request_kind: :call}} = next_event(@call ++ [:start])
      wait_until(fn -> running?(hd(workers!(pool)).pid) end)
      System.cmd("kill", ["-KILL", "#{os_pid}"])

      assert {:error, %Error{type: :worker_exit}} = Task.await(task, 30_000)

      {exit_m, exit_md} = next_event([:vllm_bridge, :worker, :exit])

      assert %{pool: ^pool, index: 0, os_pid: ^os_pid, instance: ^instance, restarts: 0} = exit_md

      assert %{phase: :ready, reason: reason} = exit_md
      assert reason =~ "exited with status"
      assert exit_m.in_flight == 1 and exit_m.duration > 0

      {stop_m, stop_md} = next_event(@call ++ [:stop])
      assert %{error: :worker_exit, worker: 0} = stop_md
      assert stop_m.reply_bytes == 0

      # Its successor: the same index, started once before it.
      {start_m, start_md} = next_event([:vllm_bridge, :worker, :start], 60_000)
      assert %{pool: ^pool, index: 0, restarts: 1, device: device} = start_md
      assert device?(device)
      assert start_md.os_pid != os_pid and start_md.instance != instance
      assert start_m.handshake_time > 0 and start_m.duration >= start_m.handshake_time
    end
  end

  describe "worker start and stop" do
    test "each worker's :start as the pool starts, and :stop as it stops" do
      pool = :tel_life
      record(pool, worker_events())
      {:ok, _} = VllmBridge.start_pool(pool, size: 2)
      # (Stopped below; this only for a test that fails before.)
      on_exit(fn -> VllmBridge.stop_pool(pool) end)

      starts = for _ <- 1..2, do: next_event([:vllm_bridge, :worker, :start])
      {:ok, ws} = VllmBridge.Pool.workers(pool)

      for {start_m, md} <- starts do
        w = Enum.at(ws, md.index)
        assert %{os_pid: os_pid, instance: instance, restarts: 0, device: device} = md
        assert device?(device)
        assert {os_pid, instance} == {w.os_pid, w.instance}
        assert start_m.handshake_time > 0 and start_m.duration >= start_m.handshake_time
        assert is_integer(start_m.system_time)
      end

      assert Enum.sort(for {_, md} <- starts, do: md.index) == [0, 1]

      :ok = VllmBridge.stop_pool(pool)
      stops = for _ <- 1..2, do: next_event([:vllm_bridge, :worker, :stop])
      assert Enum.sort(for {_, md} <- stops, do: md.index) == [0, 1]

      for {stop_m, md} <- stops do
        assert %{reason: :shutdown, phase: :ready, restarts: 0} = md
        assert stop_m.duration > 0
      end

      refute_event([:vllm_bridge, :worker, :exit])
    end

    test "a start that fails is an :exit in the phase :starting" do
      pool = :tel_bad_start
      record(pool, worker_events())

      assert {:error, %Error{}} =
               VllmBridge.start_pool(pool,
                 size: 1,
                 on_start: {@diag, "fail", ["no setup"], %{}}
               )

      {exit_m, md} = next_event([:vllm_bridge, :worker, :exit])
      assert %{pool: ^pool, index: 0, phase: :starting, restarts: 0} = md
      assert md.reason =~ "no setup"
      assert exit_m.in_flight == 0
      # The failed worker was already reported gone: no :stop when the pool is stopped.
      refute_event([:vllm_bridge, :worker, :stop])
      refute_event([:vllm_bridge, :worker, :start])
    end
  end

  describe "queue_full" do
    test "the refused caller emits it, and its call's :stop says :queue_full" do
      pool = start_pool!(:tel_full, size: 1, max_in_flight: 1, queue_size: 0)
      await_idle!(pool)
      held = hold(pool_name: pool)
      record(pool, call_events() ++ [[:vllm_bridge, :pool, :queue_full]])

      assert {:error, %Error{type: :queue_full}} =
               VllmBridge.call({@diag, "add"}, [1, 2], %{}, pool_name: pool)

      {full_m, full_md} = next_event([:vllm_bridge, :pool, :queue_full])
      assert full_md == %{pool: pool, worker: nil}
      assert full_m.queue_size == 0 and is_integer(full_m.system_time)

      {_, _, :stop, _, stop_md} = next_span(@call)
      assert %{error: :queue_full, worker: nil} = stop_md

      unhold(held)
    end
  end
end
