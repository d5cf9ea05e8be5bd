defmodule VllmBridge.Runtime.CurrentSessionTest do
  @moduledoc """
  The process's current session: while `with_session/2` or a `with_…` form runs its
  function, calls from that process that name no `session_id` (and no other pool) run in
  the session; `enter` needs a session and is refused without one.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Session}

  @pool :rt_current
  @other :rt_current_other
  @fc "vllm_bridge.forward_context"

  setup_all do
    start_pool!(@pool, size: 2)
    start_pool!(@other, size: 1)
    :ok
  end

  defp diag(fun, args, opts \\ []),
    do: VllmBridge.call({"vllm_bridge.bridge.diag", fun}, args, %{}, [pool_name: @pool] ++ opts)

  test "inside with_session, calls without session_id run in the session" do
    {:ok, {s_id, seen}} =
      VllmBridge.with_session(
        fn s ->
          assert Session.current() == s
          # No session_id: the current session (diag's variable is per session).
          assert {:ok, nil} = VllmBridge.call({"vllm_bridge.bridge.diag", "set_var"}, [41])

          {:ok,
           {s.id,
            VllmBridge.call({"vllm_bridge.bridge.diag", "get_var"}, [], %{}, session_id: s.id)}}
        end,
        pool_name: @pool
      )

    assert seen == {:ok, 41}
    assert Session.current() == nil
    assert {:error, %Error{type: :bad_argument}} = Session.lookup(s_id)
  end

  test "session_id: nil opts out, and a call naming another pool runs there" do
    VllmBridge.with_session(
      fn _s ->
        assert {:ok, nil} = diag("set_var", [7])
        assert {:ok, 7} = diag("get_var", [])
        # The workers' default session is another one (nothing set there in this pool).
        assert {:ok, nil} = diag("get_var", [], session_id: nil)
        # Another pool: the session (of @pool) does not apply; no error either.
        assert {:ok, 3} =
                 VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [1, 2], %{},
                   pool_name: @other
                 )
      end,
      pool_name: @pool
    )
  end

  test "nested sessions: the inner one is current inside, the outer one after it" do
    VllmBridge.with_session(
      fn outer ->
        VllmBridge.with_session(fn inner -> assert Session.current() == inner end,
          pool_name: @pool
        )

        assert Session.current() == outer
      end,
      pool_name: @pool
    )

    assert Session.current() == nil
  end

  test "the current session is restored when the function raises, and tasks do not inherit it" do
    assert_raise RuntimeError, "boom", fn ->
      VllmBridge.with_session(fn _ -> raise "boom" end, pool_name: @pool)
    end

    assert Session.current() == nil

    VllmBridge.with_session(
      fn _ -> assert Task.await(Task.async(fn -> Session.current() end)) == nil end,
      pool_name: @pool
    )
  end

  test "enter without a session is refused, naming the target and the remedy" do
    cfg = %Vllm.Config.VllmConfig{}

    assert {:error, %Error{type: :bad_argument, message: m}} =
             VllmBridge.enter({@fc, "set_forward_context"}, [nil, cfg], %{}, pool_name: @pool)

    assert m =~
             ~s(enter of {"vllm_bridge.forward_context", "set_forward_context"} needs a session)

    assert m =~ "with_context/5"
    # Nothing was left entered in the default session.
    assert {:ok, false} =
             VllmBridge.call({@fc, "is_forward_context_available"}, [], %{}, pool_name: @pool)
  end

  test "with_context without a session opens one: the body's calls see the context" do
    cfg = %Vllm.Config.VllmConfig{}

    assert {:ok, {{:ok, true}, %Session{} = s}} =
             VllmBridge.with_context(
               {@fc, "set_forward_context"},
               [nil, cfg],
               %{},
               [pool_name: @pool],
               fn nil ->
                 {VllmBridge.call({@fc, "is_forward_context_available"}), Session.current()}
               end
             )

    # Exited, and the temporary session is closed.
    assert Session.current() == nil
    assert {:error, %Error{type: :bad_argument}} = Session.lookup(s.id)

    assert {:ok, false} =
             VllmBridge.call({@fc, "is_forward_context_available"}, [], %{}, pool_name: @pool)
  end

  test "with_context in a given session makes it current for the body" do
    VllmBridge.with_session(
      fn s ->
        assert {:ok, :ok} =
                 VllmBridge.with_context(
                   {@fc, "set_forward_context"},
                   [nil, %Vllm.Config.VllmConfig{}],
                   %{},
                   [session_id: s.id],
                   fn _ ->
                     assert Session.current() == s
                     assert {:ok, true} = VllmBridge.call({@fc, "is_forward_context_available"})
                     :ok
                   end
                 )

        assert {:ok, false} = VllmBridge.call({@fc, "is_forward_context_available"})
      end,
      pool_name: @pool
    )
  end
end
