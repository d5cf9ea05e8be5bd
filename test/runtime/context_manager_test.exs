defmodule VllmBridge.Runtime.ContextManagerTest do
  @moduledoc """
  Context managers through a pool: `enter`/`exit`/`with_context` return the value, always
  exit, pass the failure of the Elixir side to `__exit__` (the real Python exception when
  it came from a call in the session), honour suppression, and release their handles.
  """
  use ExUnit.Case, async: false
  @pool :rt_context
  use VllmBridge.StreamContextCase

  alias VllmBridge.Call.{Request, Wire}

  # Sends an enter of diag.recorder(name) in session `s` straight to worker `w`, as
  # VllmBridge.enter/4 would, without waiting: the request's handle.
  defp send_enter(w, s, name) do
    {:ok, parts} = Wire.encode_invoke({"vllm_bridge.bridge.diag", "recorder"}, [name], %{})
    req = Request.new("enter", pre: [Wire.value(s.id)], post: parts)
    Request.send_request(w, req, :infinity)
  end

  describe "context managers" do
    test "enter returns the handle and value; exit leaves the context" do
      s = session!()

      assert {:ok, {%Ref{type: "context"} = h, "a"}} =
               VllmBridge.enter(
                 {"vllm_bridge.bridge.diag", "recorder"},
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
                 {"vllm_bridge.bridge.diag", "recorder"},
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
          {"vllm_bridge.bridge.diag", "recorder"},
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
        VllmBridge.with_context({"vllm_bridge.bridge.diag", "recorder"}, ["d"], %{}, o, fn _ ->
          raise ArgumentError, "bad thing"
        end)
      end

      assert catch_throw(
               VllmBridge.with_context(
                 {"vllm_bridge.bridge.diag", "recorder"},
                 ["e"],
                 %{},
                 o,
                 fn _ ->
                   throw(:ball)
                 end
               )
             ) == :ball

      assert catch_exit(
               VllmBridge.with_context(
                 {"vllm_bridge.bridge.diag", "recorder"},
                 ["f"],
                 %{},
                 o,
                 fn _ ->
                   exit(:gone)
                 end
               )
             ) == :gone

      assert [
               %{
                 "name" => "d",
                 "type" => "vllm_bridge.bridge.worker.CallerError",
                 "message" => "bad thing"
               },
               %{
                 "name" => "e",
                 "type" => "vllm_bridge.bridge.worker.CallerError",
                 "message" => m_throw
               },
               %{
                 "name" => "f",
                 "type" => "vllm_bridge.bridge.worker.CallerError",
                 "message" => m_exit
               }
             ] = exit_log()

      assert m_throw =~ "throw" and m_throw =~ ":ball"
      assert m_exit =~ "exit" and m_exit =~ ":gone"
      # Every context was left: the session's variable is back to nothing.
      assert {:ok, nil} = diag("get_var", [], session_id: s.id)
    end

    test "exit with an error: a message, an exception; suppression is reported" do
      o = opts(session_id: session!().id)
      {:ok, {h, _}} = VllmBridge.enter({"vllm_bridge.bridge.diag", "recorder"}, ["g"], %{}, o)
      assert {:ok, false} = VllmBridge.exit(h, "went wrong")

      {:ok, {h, _}} =
        VllmBridge.enter({"vllm_bridge.bridge.diag", "recorder"}, ["h"], %{suppress: true}, o)

      assert {:ok, true} = VllmBridge.exit(h, %RuntimeError{message: "swallowed"})

      assert [
               %{
                 "name" => "g",
                 "type" => "vllm_bridge.bridge.worker.CallerError",
                 "message" => "went wrong"
               },
               %{
                 "name" => "h",
                 "type" => "vllm_bridge.bridge.worker.CallerError",
                 "message" => "swallowed"
               }
             ] = exit_log()
    end

    test "a suppressing __exit__ makes with_context return {:ok, nil}" do
      assert {:ok, nil} =
               VllmBridge.with_context(
                 {"vllm_bridge.bridge.diag", "recorder"},
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
        VllmBridge.with_context({"vllm_bridge.bridge.diag", "recorder"}, ["n"], %{}, o, fn _ ->
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
        VllmBridge.with_context({"vllm_bridge.bridge.diag", "recorder"}, ["p"], %{}, o, fn _ ->
          # Another session's long call (a stream, until unhold) occupies the worker when
          # the body ends.
          busy = hold(pool_name: @pool, session_id: other.id)
          send(me, {:busy, busy})

          wait_until(fn -> running?(w) end)

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

    test "an enter that times out while __enter__ runs leaves no context behind",
         %{w: w, meta: meta} do
      s = session!()
      {:ok, %{"refs" => refs}} = Worker.ping(w)

      assert {:error, %Error{type: :timeout, message: m}} =
               VllmBridge.enter(
                 {"vllm_bridge.bridge.diag", "recorder"},
                 ["late", false, 0.3],
                 %{},
                 opts(session_id: s.id, timeout: 50)
               )

      assert m =~ "enter"
      wait_until(fn -> worker_idle?(w, meta) end)
      # Exited cleanly once __enter__ returned; the session is as it was.
      assert [%{"name" => "late", "type" => nil}] = exit_log()
      assert {:ok, nil} = diag("get_var", [], session_id: s.id)
      assert {:ok, %{"refs" => ^refs}} = Worker.ping(w)
      refute_received {_, :reply, _, _}
    end

    test "an enter given up after it finished is exited before the session's next call",
         %{w: w, meta: meta} do
      s = session!()
      {:ok, %{"refs" => refs}} = Worker.ping(w)
      # The caller gives up before the worker process has seen the reply (both messages
      # wait in its mailbox): it answers :cancelled, and the reply, ok, is dropped.
      :sys.suspend(w)
      {_, id, mref} = send_enter(w, s, "orphan")
      VllmBridge.Worker.Messages.send_settle(w, id, mref)
      :sys.resume(w)

      assert_receive {^mref, :cancelled, nil}, 5_000
      # At once, no waiting: the session's next call already runs outside the context.
      assert {:ok, nil} = diag("get_var", [], session_id: s.id)
      assert [%{"name" => "orphan", "type" => nil}] = exit_log()
      wait_until(fn -> worker_idle?(w, meta) end)
      assert {:ok, %{"refs" => ^refs}} = Worker.ping(w)
      refute_received {^mref, :reply, _, _}
    end

    test "an enter whose caller dies while __enter__ runs leaves no context behind",
         %{w: w, meta: meta} do
      s = session!()
      me = self()

      pid =
        spawn(fn ->
          send(me, :entering)

          VllmBridge.enter(
            {"vllm_bridge.bridge.diag", "recorder"},
            ["dead", false, 0.3],
            %{},
            opts(session_id: s.id)
          )
        end)

      assert_receive :entering
      wait_until(fn -> running?(w) end)
      Process.exit(pid, :kill)
      wait_until(fn -> worker_idle?(w, meta) end)
      assert {:ok, nil} = diag("get_var", [], session_id: s.id)
      assert [%{"name" => "dead", "type" => nil}] = exit_log()
    end

    test "a caller that gives up on an enter whose reply was passed on keeps the context",
         %{w: w} do
      s = session!()
      {_, _, mref} = handle = send_enter(w, s, "mine")
      # The reply is in this process's mailbox, not yet taken, when the caller gives up.
      wait_until(fn -> match?({:messages, [_ | _]}, Process.info(self(), :messages)) end)

      assert {:ok, [%Ref{type: "context"} = h, "mine"]} = Request.give_up(handle, "late")
      assert {:ok, "mine"} = diag("get_var", [], session_id: s.id)
      assert exit_log() == []
      assert {:ok, false} = VllmBridge.exit(h, nil, opts(session_id: s.id))
      assert [%{"name" => "mine", "type" => nil}] = exit_log()
      refute_received {^mref, _, _}
    end

    test "a settle always ends: the worker answers one for a request it no longer has",
         %{w: w} do
      mref = :erlang.monitor(:process, w, [{:alias, :reply_demonitor}])

      assert {:error, %Error{type: :timeout, message: "gone"}} =
               Request.give_up({w, 987_654_321, mref}, "gone")
    end

    test "a context that cannot be entered: the error, and the fun never runs" do
      assert {:error, %Error{type: :python_exception, python_type: "TypeError"}} =
               VllmBridge.with_context(
                 {"vllm_bridge.bridge.diag", "recorder"},
                 [5],
                 %{},
                 opts(),
                 fn _ ->
                   flunk("ran")
                 end
               )

      assert {:error, %Error{type: :bad_argument, message: m}} =
               VllmBridge.enter(
                 {"vllm_bridge.bridge.diag", "add"},
                 [1, 2],
                 %{},
                 opts(session_id: session!().id)
               )

      assert m =~ "not a context manager"
      assert exit_log() == []
    end

    test "releasing a handle exits the context first; closing a session exits the rest",
         %{w: w} do
      s = session!()
      o = opts(session_id: s.id)
      {:ok, base} = Worker.ping(w)
      {:ok, {h1, _}} = VllmBridge.enter({"vllm_bridge.bridge.diag", "recorder"}, ["j"], %{}, o)
      {:ok, {_h2, _}} = VllmBridge.enter({"vllm_bridge.bridge.diag", "recorder"}, ["k"], %{}, o)
      {:ok, {_h3, _}} = VllmBridge.enter({"vllm_bridge.bridge.diag", "recorder"}, ["l"], %{}, o)
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
      o = opts(session_id: session!().id)
      {:ok, {h, _}} = VllmBridge.enter({"vllm_bridge.bridge.diag", "recorder"}, ["m"], %{}, o)
      assert {:error, %Error{type: :bad_argument, message: m}} = VllmBridge.exit(h, 123)
      assert m =~ "123"
      assert {:ok, false} = VllmBridge.exit(h)
    end

    test "with_context and with_session refuse what is not a function, by value" do
      assert {:error, %Error{type: :bad_argument, message: m}} =
               VllmBridge.with_context(
                 {"vllm_bridge.bridge.diag", "recorder"},
                 ["x"],
                 %{},
                 opts(),
                 :nope
               )

      assert m =~ "with_context needs a function of one argument" and m =~ ":nope"

      assert {:error, %Error{type: :bad_argument, message: m}} =
               VllmBridge.with_session("not a fun", pool_name: @pool)

      assert m =~ "with_session needs a function of one argument" and m =~ ~s("not a fun")
      # Nothing was entered or opened on the way.
      assert exit_log() == []
    end
  end
end
