defmodule VllmBridge.Distribution.NetsplitTest do
  @moduledoc """
  A connection between two nodes that drops and comes back (a netsplit that heals, both
  nodes living on): the peer closed this node's sessions there and released its loose
  references when it saw their owners go, so requests in those sessions or on those
  references answer `:session_lost` naming the node, and closing such a session is `:ok`.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log
  @moduletag :distributed

  import VllmBridge.RuntimeHelpers
  import VllmBridge.PeerHelpers

  alias VllmBridge.{Error, Pool, Ref, Session}

  @pool :dist_split
  @diag "vllm_bridge.bridge.diag"

  # Checked at compile time without starting anything; distribution starts in
  # start_peer!/2.
  if why = VllmBridge.PeerHelpers.unavailable(),
    do: @moduletag(skip: "distributed Erlang cannot start here: #{why}")

  setup_all do
    {peer, b} = start_peer!(:dist_n, connection: :standard_io)
    on_exit(fn -> stop_peer(peer) end)
    start_pool_on!(b, @pool, size: 1)
    %{b: b, peer: peer}
  end

  defp diag(fun, args, opts), do: VllmBridge.call({@diag, fun}, args, %{}, opts)

  # Drops the connection to `b` and makes it again, once `b` has closed what this
  # node's processes had there.
  defp split_and_heal(b, peer, session_id) do
    true = Node.disconnect(b)
    wait_until(fn -> b not in Node.list() end)

    wait_until(fn ->
      match?({:error, _}, :peer.call(peer, Session, :lookup, [session_id]))
    end)

    true = Node.connect(b)
    wait_until(fn -> Pool.nodes(@pool) == [b] end)
  end

  test "after a connection drop that heals, the peer's sessions and loose references are lost",
       %{b: b, peer: peer} do
    {:ok, s} = Session.open(pool_name: @pool)
    assert s.node == b
    {:ok, _} = diag("set_var", ["kept"], session_id: s.id)
    {:ok, %Ref{node: ^b} = loose} = diag("opaque", [1], pool_name: @pool)
    {:ok, %Ref{node: ^b} = in_s} = diag("opaque", [2], session_id: s.id)

    split_and_heal(b, peer, s.id)

    for {what, result} <- [
          session: diag("get_var", [], session_id: s.id),
          session_struct: diag("get_var", [], session_id: s),
          session_ref: VllmBridge.get({in_s, "value"}),
          loose_ref: VllmBridge.get({loose, "value"})
        ] do
      assert {:error, %Error{type: :session_lost, message: m}} = result, inspect(what)
      assert m =~ inspect(b) and m =~ "connection", m
    end

    assert_raise Error, ~r/session_lost|connection/, fn ->
      {:ok, st} = VllmBridge.stream({@diag, "count"}, [3], %{}, session_id: s.id)
      Enum.to_list(st)
    end

    assert :ok = Session.close(s)
    assert {:error, %Error{type: :bad_argument}} = Session.close(s)

    # The node serves again: new sessions and calls work.
    assert {:ok, 3} = diag("add", [1, 2], pool_name: @pool)

    VllmBridge.with_session(
      fn s2 ->
        assert s2.node == b
        {:ok, _} = diag("set_var", ["again"], [])
        assert {:ok, "again"} = diag("get_var", [], [])
      end,
      pool_name: @pool
    )
  end

  test "a request reaching a node that no longer knows its session answers :session_lost there",
       %{b: b} do
    {:ok, s} = Session.open(pool_name: @pool)
    # Closed on its node behind this node's back: this node still routes to it.
    :ok = :erpc.call(b, Session, :close, [s.id])

    assert {:error, %Error{type: :session_lost, message: m}} =
             diag("get_var", [], session_id: s.id)

    assert m =~ "is not open on node #{inspect(b)}", m

    assert_raise Error, ~r/is not open on node/, fn ->
      {:ok, st} = VllmBridge.stream({@diag, "count"}, [3], %{}, session_id: s.id)
      Enum.to_list(st)
    end

    # Nothing of it was made again there (a request naming an unknown session would
    # create it in the worker).
    assert {:error, _} = :erpc.call(b, Session, :lookup, [s.id])
    _ = Session.close(s)
  end
end
