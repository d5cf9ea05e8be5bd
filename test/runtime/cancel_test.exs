defmodule VllmBridge.Runtime.CancelTest do
  @moduledoc """
  Cancel in place: a call that times out (or whose caller dies) is interrupted inside
  Python; the worker, its sessions and their state stay, and the next call answers
  normally, without waiting out `cancel_grace`. Only a call that does not stop within
  `cancel_grace` (stuck in C code: `cancel_support.stuck`, python/tests/bridge, blocks the
  interrupt signal)
  costs the Python process, and every call and session that loses it says why.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Session}

  @pool :rt_cancel
  # Short enough that a call which was not interrupted would cost the worker within the
  # test (its session then lost), long enough for a busy machine to deliver the cancel.
  @grace 2_000
  # The Python loop the issue names: 20 s, given up after 300 ms.
  @loop_s 20.0
  @interrupted "vllm_bridge.bridge.protocol.errors.CallInterrupted"

  setup_all do
    start_pool!(@pool,
      size: 1,
      max_in_flight: 4,
      cancel_grace: @grace,
      allow: ["vllm_bridge.bridge.diag", "cancel_support"],
      worker_env: [python_path([python_support_dir()])]
    )

    :ok
  end

  setup do
    {[%{instance: instance, os_pid: os_pid}], meta} = await_idle!(@pool)
    {:ok, _} = diag("exit_log", [true])
    %{instance: instance, os_pid: os_pid, meta: meta}
  end

  defp diag(fun, args, opts \\ []),
    do: VllmBridge.call({"vllm_bridge.bridge.diag", fun}, args, %{}, [pool_name: @pool] ++ opts)

  defp session! do
    {:ok, s} = Session.open(pool_name: @pool)
    on_exit(fn -> Session.close(s) end)
    s
  end

  # The worker's Python process, its OS pid and instance, are still the ones of `ctx`.
  defp same_worker!(%{instance: instance, os_pid: os_pid}) do
    assert [%{instance: ^instance, os_pid: ^os_pid}] = workers!(@pool)
    assert {:ok, %{"pid" => ^os_pid}} = diag("info", [])
  end

  defp interrupted?(name) do
    match?({:ok, [%{"name" => ^name, "type" => @interrupted}]}, diag("exit_log", []))
  end

  test "a session's call that times out is interrupted; the session's next call answers",
       ctx do
    s = session!()
    {:ok, nil} = diag("set_var", ["kept"], session_id: s.id)

    assert {:error, %Error{type: :timeout, message: m}} =
             diag("spin", [@loop_s], session_id: s.id, timeout: 300)

    assert m =~ "vllm_bridge.bridge.diag.spin" and m =~ "timeout 300 ms"

    # The next call of the session: its state intact, on the same process, answered while
    # the 20 s loop would still be running (it was interrupted, not waited for).
    assert {:ok, "kept"} = diag("get_var", [], session_id: s.id)
    same_worker!(ctx)
    assert interrupted?("spin")
  end

  test "a call outside any session is interrupted the same way", ctx do
    assert {:error, %Error{type: :timeout}} = diag("spin", [@loop_s], timeout: 300)
    assert {:ok, 5} = diag("add", [2, 3])
    same_worker!(ctx)
    assert interrupted?("spin")
  end

  test "a blocking call (a sleep) is interrupted", ctx do
    s = session!()

    assert {:error, %Error{type: :timeout}} =
             diag("sleep", [@loop_s], session_id: s.id, timeout: 300)

    assert {:ok, 2} = diag("add", [1, 1], session_id: s.id)
    same_worker!(ctx)
  end

  test "a stream whose chunk takes too long is interrupted inside its generator", ctx do
    s = session!()
    {:ok, nil} = diag("set_var", ["streamed"], session_id: s.id)

    # The generator takes 20 s to compute each chunk; the stream waits 300 ms for one.
    {:ok, slow} =
      VllmBridge.stream({"vllm_bridge.bridge.diag", "count"}, [3, @loop_s, "slow"], %{},
        pool_name: @pool,
        session_id: s.id,
        timeout: 300
      )

    assert %Error{type: :timeout} = catch_error(Enum.to_list(slow))
    assert {:ok, "streamed"} = diag("get_var", [], session_id: s.id)
    same_worker!(ctx)
    assert interrupted?("slow")

    {:ok, again} =
      VllmBridge.stream({"vllm_bridge.bridge.diag", "count"}, [2], %{},
        pool_name: @pool,
        session_id: s.id
      )

    assert Enum.to_list(again) == [0, 1]
  end

  test "a caller that dies mid-call: its call is interrupted, the worker kept", ctx do
    s = session!()
    {:ok, nil} = diag("set_var", ["survives"], session_id: s.id)
    me = self()

    caller =
      spawn(fn ->
        send(me, :calling)
        diag("spin", [@loop_s], session_id: s.id, timeout: :infinity)
      end)

    assert_receive :calling
    [%{pid: w}] = workers!(@pool)
    wait_until(fn -> running?(w) end)
    Process.exit(caller, :kill)

    wait_until(fn -> worker_idle?(w, ctx.meta) end, 15_000, "the dead caller's call stopped")
    assert {:ok, "survives"} = diag("get_var", [], session_id: s.id)
    same_worker!(ctx)
    assert interrupted?("spin")
  end

  test "a call stuck in C past cancel_grace costs the process; every loser is told why",
       ctx do
    s = session!()
    me = self()

    stuck =
      Task.async(fn ->
        send(me, :stuck_sent)

        VllmBridge.call({"cancel_support", "stuck"}, [60], %{},
          pool_name: @pool,
          session_id: s.id,
          timeout: 300
        )
      end)

    assert_receive :stuck_sent
    [%{pid: w}] = workers!(@pool)
    wait_until(fn -> running?(w) end)
    # Pipelined behind it, with a long deadline of its own: it loses the worker.
    behind = Task.async(fn -> diag("add", [1, 1], timeout: 60_000) end)

    assert {:error, %Error{type: :timeout}} = Task.await(stuck, 30_000)
    assert {:error, %Error{type: :worker_exit, message: why}} = Task.await(behind, 30_000)

    assert why =~ "was killed because request"
    assert why =~ ~s(call {"cancel_support", "stuck"})
    assert why =~ "after it was cancelled (cancel_grace #{@grace} ms"

    # A new process; the session that lived on the old one is lost, and says why.
    [%{instance: new}] = workers!(@pool)
    assert new != ctx.instance

    assert {:error, %Error{type: :session_lost, message: lost}} =
             diag("get_var", [], session_id: s.id)

    assert lost =~ "which restarted or stopped (the Python process"
    assert lost =~ "was killed because request"
    assert {:ok, 2} = diag("add", [1, 1])
  end

  test "many timed-out calls in a row leave the session and the process as they were", ctx do
    s = session!()
    {:ok, nil} = diag("set_var", [:many], session_id: s.id)

    for i <- 1..12 do
      # Some given up while running, some while queued behind the one before.
      timeout = Enum.at([1, 20, 60, 150], rem(i, 4))

      assert {:error, %Error{type: :timeout}} =
               diag("spin", [@loop_s], session_id: s.id, timeout: timeout)
    end

    assert {:ok, :many} = diag("get_var", [], session_id: s.id)
    same_worker!(ctx)
  end
end
