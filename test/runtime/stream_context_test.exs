defmodule VllmBridge.Runtime.StreamContextTest do
  @moduledoc """
  Streams and context managers through a pool: every chunk arrives, halting early
  cancels the generator and gives the slot back, a Python error mid-stream raises, the
  per-chunk timeout; `enter`/`exit`/`with_context` return the value, always exit, pass the
  failure of the Elixir side to `__exit__` (the real Python exception when it came from a
  call in the session), honour suppression, and release their handles.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Pool, Ref, Session, Worker}
  alias VllmBridge.Pool.Slots

  @pool :rt_stream

  setup_all do
    start_pool!(@pool,
      size: 1,
      max_in_flight: 2,
      allow: ["vllm_bridge.diag", "rt_stream_support"],
      worker_env: [{"PYTHONPATH", support_dir()}]
    )

    :ok
  end

  setup do
    [%{pid: w}] = workers!(@pool)
    {:ok, meta} = Pool.meta(@pool)
    wait_until(fn -> idle?(w, meta) end)
    {:ok, _} = diag("exit_log", [true])
    %{w: w, meta: meta}
  end

  defp idle?(w, meta) do
    Slots.load(meta, 0) == 0 and
      match?({:ok, %{"running" => nil, "queued" => 0}}, Worker.ping(w))
  end

  defp opts(extra \\ []), do: [pool_name: @pool] ++ extra

  defp diag(fun, args, extra \\ []),
    do: VllmBridge.call({"vllm_bridge.diag", fun}, args, %{}, opts(extra))

  defp stream!(fun, args, kwargs \\ %{}, extra \\ []) do
    {:ok, s} = VllmBridge.stream({"vllm_bridge.diag", fun}, args, kwargs, opts(extra))
    s
  end

  defp exit_log, do: elem(diag("exit_log", []), 1)

  defp session!(extra \\ []) do
    {:ok, s} = Session.open([pool_name: @pool] ++ extra)
    on_exit(fn -> Session.close(s) end)
    s
  end

  describe "streams" do
    test "every chunk arrives, in order; the stream can be enumerated twice" do
      s = stream!("count", [50])
      assert Enum.to_list(s) == Enum.to_list(0..49)
      assert Enum.sum(s) == Enum.sum(0..49)
      assert Enum.to_list(stream!("count", [0])) == []
    end

    test "nothing is sent until enumeration begins", %{w: w} do
      s = stream!("count", [3, 0.0, "lazy"])
      assert {:ok, %{"running" => nil}} = Worker.ping(w)
      assert exit_log() == []
      assert Enum.to_list(s) == [0, 1, 2]
      assert [%{"name" => "lazy", "type" => nil}] = exit_log()
    end

    test "halting early cancels the generator and gives the slot back", %{w: w, meta: meta} do
      s = stream!("count", [1_000_000, 0.01, "halted"])
      assert Enum.take(s, 3) == [0, 1, 2]

      wait_until(fn -> idle?(w, meta) end)
      # The generator was closed, not run to its end.
      assert [%{"name" => "halted", "type" => "builtins.GeneratorExit"}] = exit_log()
      # Chunks already on their way were dropped, not left in our mailbox.
      refute_received _
      assert {:ok, 3} = diag("add", [1, 2])
    end

    test "an exception in the consumer cancels too", %{w: w, meta: meta} do
      s = stream!("count", [1_000_000, 0.01, "raised"])

      assert_raise RuntimeError, "consumer failed", fn ->
        Enum.each(s, fn i -> if i == 2, do: raise("consumer failed") end)
      end

      wait_until(fn -> idle?(w, meta) end)
      assert [%{"name" => "raised", "type" => "builtins.GeneratorExit"}] = exit_log()
    end

    test "a Python error mid-stream raises VllmBridge.Error after the chunks before it",
         %{w: w, meta: meta} do
      {:ok, s} =
        VllmBridge.stream({"rt_stream_support", "fail_after"}, [3, "broke at 3"], %{}, opts())

      me = self()

      error = catch_error(Enum.each(s, &send(me, {:chunk, &1})))

      assert %Error{type: :python_exception, python_type: "RuntimeError"} = error
      assert error.message == "broke at 3"
      assert error.traceback =~ "fail_after"
      for i <- 0..2, do: assert_received({:chunk, ^i})
      wait_until(fn -> idle?(w, meta) end)
    end

    test "errors before the first chunk raise: a bad argument, a value that is not iterable" do
      assert %Error{type: :python_exception, python_type: "ValueError", message: m} =
               catch_error(Enum.to_list(stream!("count", [-1])))

      assert m =~ "-1"

      assert %Error{type: :bad_argument, message: m} =
               catch_error(Enum.to_list(stream!("add", [1, 2])))

      assert m =~ "not iterable"
      assert {:ok, 3} = diag("add", [1, 2])
    end

    test "bad arguments or options are refused before a stream exists" do
      assert {:error, %Error{type: :bad_argument}} =
               VllmBridge.stream({"vllm_bridge.diag", "count"}, [self()], %{}, opts())

      assert {:error, %Error{type: :bad_argument}} = VllmBridge.stream(:nope, [], %{}, opts())

      assert {:error, %Error{type: :bad_argument, message: m}} =
               VllmBridge.stream({"vllm_bridge.diag", "count"}, [3], %{}, opts(timeout: -1))

      assert m =~ "-1"
    end

    test "timeout bounds the wait for each chunk; the generator is cancelled",
         %{w: w, meta: meta} do
      # The first chunk comes at once, the second after 5 s: more than the 300 ms allowed.
      s = stream!("count", [2, 0.0], %{}, timeout: 300)
      assert Enum.to_list(s) == [0, 1]

      slow = stream!("count", [3, 5.0, "slow"], %{}, timeout: 300)
      assert %Error{type: :timeout, message: m} = catch_error(Enum.to_list(slow))
      assert m =~ "timeout"

      # Once the generator reaches its next chunk boundary it stops (closed, not run on).
      wait_until(fn -> idle?(w, meta) end)
      assert [%{"name" => "slow", "type" => "builtins.GeneratorExit"}] = exit_log()
    end

    test "a generator returned by a call streams from its reference" do
      s = session!()
      {:ok, %Ref{} = gen} = diag("count", [3], session_id: s.id)
      {:ok, chunks} = VllmBridge.stream({gen, nil}, [], %{}, session_id: s.id)
      assert Enum.to_list(chunks) == [0, 1, 2]
    end

    test "a stream in a session runs in the session's context" do
      s = session!()
      {:ok, nil} = diag("set_var", [10], session_id: s.id)
      # `count` itself ignores the variable; reading it after shows the session is intact.
      assert Enum.to_list(stream!("count", [2], %{}, session_id: s.id)) == [0, 1]
      assert {:ok, 10} = diag("get_var", [], session_id: s.id)
    end

    test "the worker dying mid-stream raises :worker_exit; the pool serves again" do
      [%{os_pid: os_pid, instance: inst}] = workers!(@pool)
      s = stream!("count", [1_000_000, 0.01])

      error =
        catch_error(
          Enum.each(s, fn
            2 -> System.cmd("kill", ["-9", "#{os_pid}"])
            _ -> :ok
          end)
        )

      assert %Error{type: :worker_exit} = error
      [%{instance: new}] = workers!(@pool)
      assert new != inst
      assert {:ok, 2} = diag("add", [1, 1])
    end
  end

  describe "context managers" do
    test "enter returns the handle and value; exit leaves the context" do
      s = session!()

      assert {:ok, {%Ref{type: "context"} = h, "a"}} =
               VllmBridge.enter(
                 {"vllm_bridge.diag", "recorder"},
                 ["a"],
                 %{},
                 opts(session_id: s.id)
               )

      # Entered in the session's context, which it changed.
      assert {:ok, "a"} = diag("get_var", [], session_id: s.id)
      assert {:ok, false} = VllmBridge.exit(h, nil, session_id: s.id)
      assert {:ok, nil} = diag("get_var", [], session_id: s.id)
      assert [%{"name" => "a", "type" => nil, "message" => nil}] = exit_log()

      # A handle exits once.
      assert {:error, %Error{type: :bad_argument, message: m}} = VllmBridge.exit(h)
      assert m =~ "released"
    end

    test "with_context returns the fun's value and exits cleanly" do
      s = session!()

      assert {:ok, {"b", "b"}} =
               VllmBridge.with_context(
                 {"vllm_bridge.diag", "recorder"},
                 ["b"],
                 %{},
                 opts(session_id: s.id),
                 fn value -> {value, elem(diag("get_var", [], session_id: s.id), 1)} end
               )

      assert [%{"name" => "b", "type" => nil}] = exit_log()
      assert {:ok, nil} = diag("get_var", [], session_id: s.id)
    end

    test "a Python error from a call in the session reaches __exit__ as the real exception" do
      s = session!()

      assert_raise Error, ~r/ValueError: boom/, fn ->
        VllmBridge.with_context(
          {"vllm_bridge.diag", "recorder"},
          ["c"],
          %{},
          opts(session_id: s.id),
          fn _ ->
            {:error, e} = diag("fail", ["boom"], session_id: s.id)
            raise e
          end
        )
      end

      assert [%{"name" => "c", "type" => "builtins.ValueError", "message" => "boom"}] = exit_log()
    end

    test "an Elixir failure reaches __exit__ as a CallerError with its message" do
      s = session!()
      o = opts(session_id: s.id)

      assert_raise ArgumentError, "bad thing", fn ->
        VllmBridge.with_context({"vllm_bridge.diag", "recorder"}, ["d"], %{}, o, fn _ ->
          raise ArgumentError, "bad thing"
        end)
      end

      assert catch_throw(
               VllmBridge.with_context({"vllm_bridge.diag", "recorder"}, ["e"], %{}, o, fn _ ->
                 throw(:ball)
               end)
             ) == :ball

      assert catch_exit(
               VllmBridge.with_context({"vllm_bridge.diag", "recorder"}, ["f"], %{}, o, fn _ ->
                 exit(:gone)
               end)
             ) == :gone

      assert [
               %{
                 "name" => "d",
                 "type" => "vllm_bridge.worker.CallerError",
                 "message" => "bad thing"
               },
               %{"name" => "e", "type" => "vllm_bridge.worker.CallerError", "message" => m_throw},
               %{"name" => "f", "type" => "vllm_bridge.worker.CallerError", "message" => m_exit}
             ] = exit_log()

      assert m_throw =~ "throw" and m_throw =~ ":ball"
      assert m_exit =~ "exit" and m_exit =~ ":gone"
      # Every context was left: the session's variable is back to nothing.
      assert {:ok, nil} = diag("get_var", [], session_id: s.id)
    end

    test "exit with an error: a message, an exception; suppression is reported" do
      {:ok, {h, _}} = VllmBridge.enter({"vllm_bridge.diag", "recorder"}, ["g"], %{}, opts())
      assert {:ok, false} = VllmBridge.exit(h, "went wrong")

      {:ok, {h, _}} =
        VllmBridge.enter({"vllm_bridge.diag", "recorder"}, ["h"], %{suppress: true}, opts())

      assert {:ok, true} = VllmBridge.exit(h, %RuntimeError{message: "swallowed"})

      assert [
               %{
                 "name" => "g",
                 "type" => "vllm_bridge.worker.CallerError",
                 "message" => "went wrong"
               },
               %{
                 "name" => "h",
                 "type" => "vllm_bridge.worker.CallerError",
                 "message" => "swallowed"
               }
             ] = exit_log()
    end

    test "a suppressing __exit__ makes with_context return {:ok, nil}" do
      assert {:ok, nil} =
               VllmBridge.with_context(
                 {"vllm_bridge.diag", "recorder"},
                 ["i"],
                 [suppress: true],
                 opts(),
                 fn _ -> raise "swallowed" end
               )

      assert [%{"name" => "i", "message" => "swallowed"}] = exit_log()
    end

    test "with_context exits even when the call's affinity is :strict_fail_fast and the worker is busy",
         %{meta: meta} do
      s = session!()
      o = opts(session_id: s.id, affinity: :strict_fail_fast)
      me = self()

      result =
        VllmBridge.with_context({"vllm_bridge.diag", "recorder"}, ["n"], %{}, o, fn _ ->
          # The worker is full when the body ends; it frees up once the exit waits for it.
          holds = [hold(pool_name: @pool), hold(pool_name: @pool)]
          send(me, {:holds, holds})

          spawn(fn ->
            wait_until(fn -> Slots.waiting(meta) == 1 end)
            for t <- holds, do: send(t.pid, :release)
          end)

          :body_done
        end)

      assert_received {:holds, holds}
      for t <- holds, do: send(t.pid, :release)
      for t <- holds, do: Task.await(t, 30_000)
      assert result == {:ok, :body_done}
      assert [%{"name" => "n", "type" => nil}] = exit_log()
    end

    test "an exit that times out behind a long call still runs, before the session's next call",
         %{w: w, meta: meta} do
      s = session!()
      o = opts(session_id: s.id, timeout: 200)
      other = session!()
      me = self()

      result =
        VllmBridge.with_context({"vllm_bridge.diag", "recorder"}, ["p"], %{}, o, fn _ ->
          # Another session's long call (a stream, until unhold) occupies the worker when
          # the body ends.
          busy = hold(pool_name: @pool, session_id: other.id)
          send(me, {:busy, busy})

          wait_until(fn ->
            match?({:ok, %{"running" => id}} when is_integer(id), Worker.ping(w))
          end)

          :body_done
        end)

      assert {:error, %Error{type: :timeout, message: m}} = result
      assert m =~ "still runs"
      assert_received {:busy, busy}
      # Calls run in arrival order: the session's next call, made while the exit still
      # waits (here in the pool's queue, for the exit's slot), sees the context exited.
      next = Task.async(fn -> diag("get_var", [], session_id: s.id) end)
      wait_until(fn -> Slots.waiting(meta) == 1 end)
      unhold(busy)
      assert {:ok, nil} = Task.await(next, 30_000)
      assert [%{"name" => "p", "type" => nil}] = exit_log()
    end

    test "a context that cannot be entered: the error, and the fun never runs" do
      assert {:error, %Error{type: :python_exception, python_type: "TypeError"}} =
               VllmBridge.with_context({"vllm_bridge.diag", "recorder"}, [5], %{}, opts(), fn _ ->
                 flunk("ran")
               end)

      assert {:error, %Error{type: :bad_argument, message: m}} =
               VllmBridge.enter({"vllm_bridge.diag", "add"}, [1, 2], %{}, opts())

      assert m =~ "not a context manager"
      assert exit_log() == []
    end

    test "releasing a handle exits the context first; closing a session exits the rest",
         %{w: w} do
      s = session!()
      o = opts(session_id: s.id)
      {:ok, base} = Worker.ping(w)
      {:ok, {h1, _}} = VllmBridge.enter({"vllm_bridge.diag", "recorder"}, ["j"], %{}, o)
      {:ok, {_h2, _}} = VllmBridge.enter({"vllm_bridge.diag", "recorder"}, ["k"], %{}, o)
      {:ok, {_h3, _}} = VllmBridge.enter({"vllm_bridge.diag", "recorder"}, ["l"], %{}, o)
      assert {:ok, %{"refs" => refs}} = Worker.ping(w)
      assert refs == base["refs"] + 3

      assert {:ok, 1} = VllmBridge.release(h1)
      assert [%{"name" => "j", "type" => nil}] = exit_log()
      assert {:error, %Error{type: :bad_argument}} = VllmBridge.exit(h1)

      :ok = Session.close(s)
      # In reverse order of entry.
      assert [%{"name" => "j"}, %{"name" => "l", "type" => nil}, %{"name" => "k", "type" => nil}] =
               exit_log()

      refs_after = base["refs"]
      assert {:ok, %{"refs" => ^refs_after}} = Worker.ping(w)
    end

    test "bad arguments to exit are refused by name" do
      assert {:error, %Error{type: :bad_argument, message: m}} = VllmBridge.exit(:handle)
      assert m =~ ":handle"
      {:ok, {h, _}} = VllmBridge.enter({"vllm_bridge.diag", "recorder"}, ["m"], %{}, opts())
      assert {:error, %Error{type: :bad_argument, message: m}} = VllmBridge.exit(h, 123)
      assert m =~ "123"
      assert {:ok, false} = VllmBridge.exit(h)
    end
  end
end
