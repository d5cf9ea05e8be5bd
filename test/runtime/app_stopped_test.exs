defmodule VllmBridge.Runtime.AppStoppedTest do
  @moduledoc """
  Calls while the :vllm_bridge application is not started, or before a pool exists,
  return `{:error, %VllmBridge.Error{}}` that says so; none raises. The application is
  stopped in this module only, and started again after each test (the other modules
  find it running).
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  alias VllmBridge.{Error, Pool, Ref, Session}

  @fc "vllm_bridge.forward_context"
  @ref %Ref{id: 1, instance: "gone", session: nil, type: "Opaque"}

  defp not_started!(result) do
    assert {:error, %Error{type: :bad_argument, message: m}} = result
    assert m =~ ":vllm_bridge application is not started"
  end

  describe "with the application stopped" do
    setup do
      :ok = Application.stop(:vllm_bridge)
      on_exit(fn -> {:ok, _} = Application.ensure_all_started(:vllm_bridge) end)
    end

    test "calls, reads, sessions, contexts and call_all return the error" do
      not_started!(VllmBridge.call({@fc, "is_forward_context_available"}))
      not_started!(VllmBridge.call({@fc, "is_forward_context_available"}, [], %{}, pool_name: :x))
      not_started!(VllmBridge.get({@fc, "track_batchsize"}))
      not_started!(VllmBridge.call_all(:default, {@fc, "is_forward_context_available"}))
      not_started!(VllmBridge.enter({@fc, "set_forward_context"}, [], %{}, session_id: "s-1"))
      not_started!(VllmBridge.with_session(fn _ -> :never end))

      not_started!(
        VllmBridge.with_context({@fc, "set_forward_context"}, [], %{}, [], fn _ -> :never end)
      )

      not_started!(Session.open())
      not_started!(Session.close("s-1"))
      not_started!(VllmBridge.call({@fc, "x"}, [], %{}, session_id: "s-1"))
      assert {:error, %Error{}} = VllmBridge.release(@ref)
      assert {:error, %Error{}} = VllmBridge.call({@ref, "x"})
    end

    test "a stream is refused at once, never made to raise when enumerated" do
      not_started!(VllmBridge.stream({"vllm_bridge.bridge.diag", "count"}, [3]))

      not_started!(
        VllmBridge.stream({"vllm_bridge.bridge.diag", "count"}, [3], %{}, pool_name: :x)
      )
    end

    test "pools: start, stop, workers, readiness and names" do
      not_started!(VllmBridge.start_pool(:x, size: 1))
      not_started!(VllmBridge.stop_pool(:x))
      not_started!(Pool.workers(:x))
      not_started!(Pool.await_ready(:x, 100))
      not_started!(Pool.meta(:x))
      assert Pool.names() == []
    end
  end

  test "with the application running, a pool that does not exist is named" do
    assert {:error, %Error{type: :bad_argument, message: m}} =
             VllmBridge.call({@fc, "is_forward_context_available"}, [], %{}, pool_name: :as_none)

    assert m =~ "pool :as_none is not started"

    assert {:error, %Error{message: m}} = VllmBridge.call_all(:as_none, {@fc, "x"})
    assert m =~ "pool :as_none is not started"
    assert {:error, %Error{message: m}} = Session.open(pool_name: :as_none)
    assert m =~ ":as_none"
  end
end
