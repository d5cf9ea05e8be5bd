defmodule VllmBridge.Distribution.ProxyDeadlineTest do
  @moduledoc """
  A remote request's runner (VllmBridge.Remote.Proxy) fixes the request's deadline on its
  own node's clock from the milliseconds that were left when the caller sent it, counted
  from the runner's start: a go that comes late (it travels back and forth between the
  two nodes, and a busy node takes its time) takes nothing away from the wait for it and
  adds nothing to the request's time. Run on this node (the runner does not care where
  its caller is): its go is sent late on purpose, and the request must end at the
  deadline its caller had, not that much later.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Call.{Runtime, Wire}
  alias VllmBridge.Remote.Proxy

  @pool :dist_proxy_deadline
  @target {"vllm_bridge.bridge.diag", "sleep"}

  setup_all do
    start_pool!(@pool, size: 1)
    :ok
  end

  # The runner of a call to sleep `seconds` with `left` ms of its deadline, whose go is
  # sent `late` ms after its start; its answer.
  defp run_late(seconds, left, late) do
    {:ok, rt} = Runtime.resolve(pool_name: @pool)
    {:ok, parts} = Wire.encode_invoke(@target, [seconds], %{})
    # (As VllmBridge.Remote.run/6 sends them: the references of the arguments.)
    opts = [what: @target, bound: nil, payload: []]
    job = {:run, %{rt | deadline: nil}, left, "call", parts, opts}
    reply = :erlang.alias([:explicit_unalias])
    caller = self()
    runner = spawn(fn -> Proxy.start(caller, reply, 60_000, job) end)
    Process.sleep(late)
    send(runner, {:go, reply})

    receive do
      {^reply, :result, result} -> result
    after
      30_000 -> flunk("the runner did not answer")
    end
  end

  test "a late go leaves the request only what was left of its deadline" do
    # 1 000 ms left when sent, the go 700 ms late: about 300 ms for a call of 600 ms,
    # which times out. Counted from the go instead, the request would have had the whole
    # 1 000 ms, ended 700 ms after its caller's deadline, and succeeded.
    assert {:error, %VllmBridge.Error{type: :timeout}} = run_late(0.6, 1_000, 700)
  end

  # The runner of a stream of `n` chunks `delay` s apart with `left` ms of stream_timeout,
  # whose go is sent `late` ms after its start; how the stream ended.
  defp stream_late(n, delay, left, late) do
    opts = [pool_name: @pool, stream_timeout: left, node: node()]
    job = {:stream, {"vllm_bridge.bridge.diag", "count"}, [n, delay], %{}, opts, nil}
    reply = :erlang.alias([:explicit_unalias])
    caller = self()
    runner = spawn(fn -> Proxy.start(caller, reply, 60_000, job) end)
    Process.sleep(late)
    send(runner, {:go, reply})
    stream_end(reply, 0)
  end

  defp stream_end(reply, chunks) do
    receive do
      {^reply, :watcher, _} -> stream_end(reply, chunks)
      {^reply, :chunk, _} -> stream_end(reply, chunks + 1)
      {^reply, :end} -> {:end, chunks}
      {^reply, :error, e} -> {:error, e.type, chunks}
    after
      30_000 -> flunk("the runner's stream did not end")
    end
  end

  test "a late go leaves a stream only what was left of its time" do
    # 6 chunks 0.1 s apart (0.6 s) with 1 000 ms of stream_timeout, the go 700 ms late.
    assert {:error, :timeout, chunks} = stream_late(6, 0.1, 1_000, 700)
    assert chunks < 6
  end

  test "a go in time runs the stream as usual" do
    assert {:end, 3} = stream_late(3, 0.0, 10_000, 0)
  end

  test "a go in time runs the request as usual" do
    assert {:ok, slept} = run_late(0.05, 10_000, 0)
    assert slept >= 0.05
  end
end
