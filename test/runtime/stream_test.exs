defmodule VllmBridge.Runtime.StreamTest do
  @moduledoc """
  Streams through a pool: every chunk arrives, halting early cancels the generator and
  gives the slot back, a Python error mid-stream raises, the per-chunk timeout.
  """
  use ExUnit.Case, async: false
  @pool :rt_stream
  use VllmBridge.StreamContextCase

  # How a generator that is stopped early ends: interrupted inside (it was computing a
  # chunk when the cancel came) or closed between chunks.
  @stopped ["vllm_bridge.bridge.protocol.errors.CallInterrupted", "builtins.GeneratorExit"]

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

      wait_until(fn -> worker_idle?(w, meta) end)
      # The generator was stopped, not run to its end.
      assert [%{"name" => "halted", "type" => type}] = exit_log()
      assert type in @stopped
      # Chunks already on their way were dropped, not left in our mailbox.
      refute_received _
      assert {:ok, 3} = diag("add", [1, 2])
    end

    test "an exception in the consumer cancels too", %{w: w, meta: meta} do
      s = stream!("count", [1_000_000, 0.01, "raised"])

      assert_raise RuntimeError, "consumer failed", fn ->
        Enum.each(s, fn i -> if i == 2, do: raise("consumer failed") end)
      end

      wait_until(fn -> worker_idle?(w, meta) end)
      assert [%{"name" => "raised", "type" => type}] = exit_log()
      assert type in @stopped
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
      wait_until(fn -> worker_idle?(w, meta) end)
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
               VllmBridge.stream({"vllm_bridge.bridge.diag", "count"}, [self()], %{}, opts())

      assert {:error, %Error{type: :bad_argument}} = VllmBridge.stream(:nope, [], %{}, opts())

      assert {:error, %Error{type: :bad_argument, message: m}} =
               VllmBridge.stream(
                 {"vllm_bridge.bridge.diag", "count"},
                 [3],
                 %{},
                 opts(timeout: -1)
               )

      assert m =~ "-1"
    end

    test "timeout bounds the wait for each chunk; the generator is interrupted",
         %{w: w, meta: meta} do
      # The first chunk comes at once, the second after 5 s: more than the 300 ms allowed.
      s = stream!("count", [2, 0.0], %{}, timeout: 300)
      assert Enum.to_list(s) == [0, 1]

      slow = stream!("count", [3, 5.0, "slow"], %{}, timeout: 300)
      assert %Error{type: :timeout, message: m} = catch_error(Enum.to_list(slow))
      assert m =~ "timeout"

      # Interrupted where it was, inside its 5 s wait for the next chunk (not run on).
      wait_until(fn -> worker_idle?(w, meta) end)

      assert [%{"name" => "slow", "type" => "vllm_bridge.bridge.protocol.errors.CallInterrupted"}] =
               exit_log()
    end

    test "a generator returned by a call streams from its reference" do
      s = session!()
      {:ok, %Ref{} = gen} = diag("count", [3], session_id: s.id)
      {:ok, chunks} = VllmBridge.stream({gen, nil}, [], %{}, session_id: s.id)
      assert Enum.to_list(chunks) == [0, 1, 2]
    end

    test "a fast generator runs at most a window ahead of a slow reader; all of it arrives" do
      s = stream!("count", [200])

      {seen, most} =
        Enum.reduce(s, {[], 0}, fn x, {seen, most} ->
          # Give the generator time to run ahead, then look at what waits in the mailbox.
          if rem(x, 40) == 0, do: Process.sleep(100)
          {:message_queue_len, n} = Process.info(self(), :message_queue_len)
          {[x | seen], max(most, n)}
        end)

      assert Enum.reverse(seen) == Enum.to_list(0..199)
      # At most a window of chunks waits; the rest of the mailbox is empty in this test.
      window = VllmBridge.Stream.window()
      assert most <= window
      assert most >= div(window, 2)
    end

    test "a reader that calls the same worker for each chunk, or reads two streams in step" do
      # One worker: each call (and the second stream) waits behind the first stream, which
      # must not wait for credit meanwhile.
      n = 3 * VllmBridge.Stream.window()

      sums =
        Enum.map(stream!("count", [n], %{}, timeout: 30_000), fn x ->
          {:ok, y} = diag("add", [x, 1], timeout: 30_000)
          y
        end)

      assert sums == Enum.to_list(1..n)

      pairs =
        Stream.zip(
          stream!("count", [n], %{}, timeout: 30_000),
          stream!("count", [n], %{}, timeout: 30_000)
        )
        |> Enum.to_list()

      assert pairs == Enum.map(0..(n - 1), &{&1, &1})
    end

    test "a stream in a session runs in the session's context" do
      s = session!()
      {:ok, nil} = diag("set_var", [10], session_id: s.id)
      # The generator reads the session's variable; outside the session it is unset.
      {:ok, seen} =
        VllmBridge.stream({"rt_stream_support", "vars_seen"}, [2], %{}, opts(session_id: s.id))

      assert Enum.to_list(seen) == [10, 10]
      {:ok, outside} = VllmBridge.stream({"rt_stream_support", "vars_seen"}, [1], %{}, opts())
      assert Enum.to_list(outside) == [nil]
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
end
