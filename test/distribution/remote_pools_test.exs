defmodule VllmBridge.Distribution.RemotePoolsTest do
  @moduledoc """
  Pools on other BEAM nodes (issue 20): a peer node on 127.0.0.1 (OTP's `:peer`) runs
  real Python workers; this node finds its pools by name (`:pg`) and uses them through
  the ordinary API: calls, gets, references, sessions, streams, context managers, under
  the same deadlines and errors; `node:` pins a node; a timeout or a caller's death
  cancels the remote call in its worker.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log
  @moduletag :distributed

  import VllmBridge.RuntimeHelpers
  import VllmBridge.PeerHelpers

  alias VllmBridge.{Error, Pool, Ref, Session}
  alias VllmBridge.Session.LooseRefs

  # Checked at compile time without starting anything; distribution starts in the
  # first start_peer!/2.
  if why = VllmBridge.PeerHelpers.unavailable(),
    do: @moduletag(skip: "distributed Erlang cannot start here: #{why}")

  @diag "vllm_bridge.bridge.diag"
  # Only on the peer.
  @remote :dist_remote
  # On both nodes.
  @both :dist_both
  @cancelled ["builtins.GeneratorExit", "vllm_bridge.bridge.protocol.errors.CallInterrupted"]

  setup_all do
    {peer, b} = start_peer!(:dist_b)
    on_exit(fn -> stop_peer(peer) end)
    start_pool_on!(b, @remote, size: 1, max_in_flight: 2, cancel_grace: 2_000)
    start_pool_on!(b, @both, size: 1)
    start_pool!(@both, size: 1)
    %{b: b}
  end

  defp diag(fun, args, opts), do: VllmBridge.call({@diag, fun}, args, %{}, opts)

  # The OS pid of the Python process that ran a call with `opts`.
  defp ran_on(opts) do
    {:ok, %{"pid" => pid}} = diag("info", [], opts)
    pid
  end

  # The remote worker's generator `name` ended cancelled (closed between two chunks, or
  # interrupted in its sleep: cancelled either way), and the pool's load is back to 0.
  defp await_cancelled_remotely(b, name) do
    wait_until(fn ->
      {:ok, log} = diag("exit_log", [], pool_name: @remote)
      Enum.any?(log, &(&1["name"] == name and &1["type"] in @cancelled))
    end)

    wait_until(fn -> remote_load(b, @remote) == 0 end)
  end

  defp remote_load(b, pool) do
    {:ok, ws} = :erpc.call(b, Pool, :workers, [pool])
    ws |> Enum.reject(&is_nil/1) |> Enum.map(& &1.load) |> Enum.sum()
  end

  describe "finding pools" do
    test "a pool started on another node is found by its name and serves calls", %{b: b} do
      assert Pool.nodes(@remote) == [b]
      assert Pool.nodes(@both) == Enum.sort([node(), b])
      refute @remote in Pool.names()

      assert {:ok, 3} = diag("add", [1, 2], pool_name: @remote)
      assert ran_on(pool_name: @remote) in os_pids_on(b, @remote)
    end

    test "large results come back whole (answers in fragments before the DOWN)" do
      for _ <- 1..5 do
        data = :crypto.strong_rand_bytes(3_000_000)
        assert {:ok, back} = diag("echo", [%VllmBridge.Bytes{data: data}], pool_name: @remote)
        assert back == data or back == %VllmBridge.Bytes{data: data}
      end
    end

    # Argument slots (ext 8) name files of this node's slot directory: a request that runs
    # on another node carries its large tensors inline. The peer first uses a slot of its
    # own of the same size (its e-0, other bytes): were our slot name sent, the peer's
    # worker would read the peer's tensor, or find no such slot.
    test "large tensors go both ways through a peer's pool, whole and ours", %{b: b} do
      size = 2 * 1_048_576
      theirs = VllmBridge.Tensor.new(:binary.copy(<<7>>, size), :uint8, [size])
      ours = VllmBridge.Tensor.new(:crypto.strong_rand_bytes(size), :uint8, [size])

      assert {:ok, ^theirs} =
               :erpc.call(b, VllmBridge, :call, [
                 {@diag, "echo"},
                 [theirs],
                 %{},
                 [pool_name: @both]
               ])

      for opts <- [[pool_name: @remote], [pool_name: @both, node: b], [pool_name: @remote]] do
        assert {:ok, back} = diag("echo", [ours], opts)
        assert back == ours, "#{inspect(opts)}: another tensor came back"
      end

      # And the local pool of the same name still takes them through this node's slots.
      assert {:ok, ^ours} = diag("echo", [ours], pool_name: @both)
    end

    test "a local pool is preferred; node: pins a node, node() this one", %{b: b} do
      [local] = for w <- workers!(@both), do: w.os_pid
      [there] = os_pids_on(b, @both)

      for _ <- 1..5, do: assert(ran_on(pool_name: @both) == local)
      assert ran_on(pool_name: @both, node: b) == there
      assert ran_on(pool_name: @both, node: node()) == local
      assert ran_on(pool_name: @remote, node: b) in os_pids_on(b, @remote)
    end

    test "the current session does not hold a call that pins another node", %{b: b} do
      [there] = os_pids_on(b, @both)

      VllmBridge.with_session(
        fn s ->
          assert s.node == node()
          assert ran_on(pool_name: @both, node: b) == there
          # Named explicitly, the session and the pinned node disagree.
          assert {:error, %Error{type: :bad_argument}} = diag("info", [], session_id: s, node: b)
        end,
        pool_name: @both
      )
    end

    test "a pool stopped on the peer leaves the routing", %{b: b} do
      start_pool_on!(b, :dist_short, size: 1)
      wait_until(fn -> Pool.nodes(:dist_short) == [b] end, 5_000)
      assert {:ok, 3} = diag("add", [1, 2], pool_name: :dist_short)
      :ok = :erpc.call(b, VllmBridge, :stop_pool, [:dist_short])
      wait_until(fn -> Pool.nodes(:dist_short) == [] end, 5_000)

      assert {:error, %Error{type: :bad_argument, message: m}} =
               diag("add", [1, 2], pool_name: :dist_short)

      assert m =~ "is not started"
    end

    test "bad node: values and pools no node has are refused, naming them", %{b: b} do
      for bad <- ["#{b}", 5, :no_at_sign, {:node, b}] do
        assert {:error, %Error{type: :bad_argument, message: m}} =
                 diag("add", [1, 2], pool_name: @both, node: bad)

        assert m =~ "node must be" and m =~ inspect(bad), m
      end

      nobody = :"nobody@127.0.0.1"

      assert {:error, %Error{type: :bad_argument, message: m}} =
               diag("add", [1, 2], pool_name: @both, node: nobody)

      assert m =~ "is not started on node #{inspect(nobody)}" and m =~ "not connected"

      assert {:error, %Error{type: :bad_argument, message: m}} =
               diag("add", [1, 2], pool_name: :dist_nowhere)

      assert m =~ "pool :dist_nowhere is not started" and m =~ "looked at: " and
               m =~ inspect(b)

      # node() pins this node, which has no such pool: not the peer's.
      assert {:error, %Error{type: :bad_argument, message: m}} =
               diag("add", [1, 2], pool_name: @remote, node: node())

      assert m =~ "pool #{inspect(@remote)} is not started on this node"

      assert {:error, %Error{type: :bad_argument, message: m}} =
               Session.open(pool_name: @both, node: "b")

      assert m =~ ~s(got "b")
    end
  end

  describe "references" do
    test "a reference from the other node carries it; gets, calls and release go there",
         %{b: b} do
      assert {:ok, %Ref{node: ^b} = ref} = diag("opaque", [5], pool_name: @remote)
      assert {:ok, 5} = VllmBridge.get({ref, "value"})
      assert {:ok, 7} = VllmBridge.call({ref, "bump"}, [2])
      # Made outside a session: it belongs to this process, on the peer.
      assert :erpc.call(b, LooseRefs, :count, [self()]) == 1

      assert {:ok, 1} = VllmBridge.release(ref)
      wait_until(fn -> :erpc.call(b, LooseRefs, :count, [self()]) == 0 end)

      assert {:error, %Error{type: :bad_argument, message: m}} = VllmBridge.get({ref, "value"})

      assert m =~ "reference #{ref.id}" and m =~ "released or never existed", m
    end

    test "a reference is refused on another node, with both nodes named", %{b: b} do
      {:ok, remote_ref} = diag("opaque", [1], pool_name: @remote)
      {:ok, local_ref} = diag("opaque", [1], pool_name: @both, node: node())
      assert local_ref.node == node()

      assert {:error, %Error{type: :bad_argument, message: m}} =
               VllmBridge.get({remote_ref, "value"}, node: node())

      assert m =~ inspect(b) and m =~ inspect(node())

      # An argument of a call that runs on the peer must be the peer's.
      assert {:error, %Error{type: :bad_argument, message: m}} =
               diag("echo", [local_ref], pool_name: @both, node: b)

      assert m =~ "lives on node #{inspect(node())}" and m =~ "runs on node #{inspect(b)}"

      # And one of the peer's, as an argument here, is refused by the worker (its instance
      # is not the worker's).
      assert {:error, %Error{type: :session_lost}} =
               diag("echo", [remote_ref], pool_name: @both, node: node())
    end

    test "a session named for a request on a reference must be open and on its node",
         %{b: b} do
      {:ok, remote_ref} = diag("opaque", [1], pool_name: @remote)
      {:ok, local_ref} = diag("opaque", [1], pool_name: @both, node: node())
      {:ok, here} = Session.open(pool_name: @both, node: node())
      {:ok, there} = Session.open(pool_name: @remote)

      for {ref, s, ref_node, s_node} <- [
            {remote_ref, here, b, node()},
            {local_ref, there, node(), b}
          ] do
        assert {:error, %Error{type: :bad_argument, message: m}} =
                 VllmBridge.get({ref, "value"}, session_id: s.id)

        assert m =~ "session #{inspect(s.id)} lives on node #{inspect(s_node)}" and
                 m =~ "on node #{inspect(ref_node)}",
               m
      end

      # A session id nobody opened is refused here, on either node, before a worker
      # could make a session of it.
      for ref <- [remote_ref, local_ref] do
        assert {:error, %Error{type: :bad_argument, message: m}} =
                 VllmBridge.get({ref, "value"}, session_id: "never-opened")

        assert m =~ ~s(unknown session_id "never-opened"), m
      end

      assert {:ok, 1} = VllmBridge.get({remote_ref, "value"})
      :ok = Session.close(here)
      :ok = Session.close(there)
    end

    test "a reference that leaves its node other than through a request names it", %{b: b} do
      # Brought back by :erpc (not by the proxy): decoded on the peer, it names the peer.
      # (In a session this process owns: the :erpc process's own references go with it.)
      {:ok, s} = Session.open(pool_name: @remote)

      {:ok, ref} =
        :erpc.call(b, VllmBridge, :call, [{@diag, "opaque"}, [4], %{}, [session_id: s.id]])

      assert ref.node == b
      # So it is routed there, not to this node's worker of the same pool name.
      assert {:ok, 4} = VllmBridge.get({ref, "value"}, pool_name: @both)
      assert {:ok, 4} = :erpc.call(b, VllmBridge, :get, [{ref, "value"}])
      :ok = Session.close(s)
    end

    test "references made for a process that exits are released on the peer", %{b: b} do
      {pid, ref} =
        Task.async(fn ->
          {:ok, r} = diag("opaque", [1], pool_name: @remote)
          {self(), r}
        end)
        |> Task.await(30_000)

      wait_until(fn -> :erpc.call(b, LooseRefs, :count, [pid]) == 0 end)

      assert {:error, %Error{type: :bad_argument, message: m}} = VllmBridge.get({ref, "value"})

      assert m =~ "reference #{ref.id}" and m =~ "released or never existed", m
    end
  end

  describe "sessions" do
    test "a session on the peer keeps its state there, and is closed there", %{b: b} do
      {:ok, s} = Session.open(pool_name: @remote)
      assert s.node == b
      assert {:ok, _} = :erpc.call(b, Session, :lookup, [s.id])

      assert {:ok, nil} = diag("set_var", ["mine"], session_id: s.id)
      assert {:ok, "mine"} = diag("get_var", [], session_id: s)
      # Another session (the default one) does not see it.
      assert {:ok, nil} = diag("get_var", [], pool_name: @remote)

      assert {:error, %Error{type: :bad_argument, message: m}} =
               diag("get_var", [], session_id: s.id, node: node())

      assert m =~ "session #{inspect(s.id)} lives on node #{inspect(b)}"

      assert :ok = Session.close(s)
      assert {:error, _} = :erpc.call(b, Session, :lookup, [s.id])

      assert {:error, %Error{type: :bad_argument, message: m}} =
               diag("get_var", [], session_id: s.id)

      assert m =~ "unknown session_id"
    end

    test "a session struct of another node that this node never registered is routed there",
         %{b: b} do
      # Opened on the peer by a call there (this node does not know it): as a struct
      # received in a message would be.
      {:ok, s} = :erpc.call(b, Session, :open, [[pool_name: @remote, owner: self()]])
      assert s.node == b
      assert {:error, _} = Session.lookup(s.id)

      assert {:ok, _} = diag("set_var", ["by-struct"], session_id: s)
      assert {:ok, "by-struct"} = diag("get_var", [], session_id: s)
      # By id alone it is unknown here.
      assert {:error, %Error{type: :bad_argument}} = diag("get_var", [], session_id: s.id)

      assert :ok = Session.close(s)
      assert {:error, _} = :erpc.call(b, Session, :lookup, [s.id])

      assert {:error, %Error{type: :session_lost, message: m}} =
               diag("get_var", [], session_id: s)

      assert m =~ "is not open on node #{inspect(b)}", m
    end

    test "with_session on a remote pool, and the owner's exit closes it there", %{b: b} do
      assert {:ok, "x"} =
               VllmBridge.with_session(
                 fn s ->
                   assert s.node == b
                   {:ok, nil} = diag("set_var", ["x"], [])
                   diag("get_var", [], [])
                 end,
                 pool_name: @remote
               )

      owner = spawn(fn -> receive do: (:stop -> :ok) end)
      {:ok, s} = Session.open(pool_name: @both, node: b, owner: owner)
      assert {:ok, _} = :erpc.call(b, Session, :lookup, [s.id])
      send(owner, :stop)
      wait_until(fn -> match?({:error, _}, :erpc.call(b, Session, :lookup, [s.id])) end)
      wait_until(fn -> match?({:error, _}, Session.lookup(s.id)) end)
    end
  end

  describe "streams and context managers" do
    test "a stream longer than a window arrives whole and in order" do
      {:ok, s} = VllmBridge.stream({@diag, "count"}, [100], %{}, pool_name: @remote)
      assert Enum.to_list(s) == Enum.to_list(0..99)
    end

    test "halting a remote stream early closes its generator there", %{b: b} do
      {:ok, _} = diag("exit_log", [true], pool_name: @remote)
      name = "halted-#{System.unique_integer([:positive])}"

      {:ok, s} =
        VllmBridge.stream({@diag, "count"}, [1_000_000, 0.001, name], %{}, pool_name: @remote)

      assert Enum.take(s, 3) == [0, 1, 2]

      await_cancelled_remotely(b, name)
    end

    test "a stream's error is raised here" do
      {:ok, s} = VllmBridge.stream({@diag, "count"}, [-1], %{}, pool_name: @remote)
      assert_raise Error, ~r/n must be a non-negative int/, fn -> Enum.to_list(s) end
    end

    test "with_context and enter/exit on the peer", %{b: b} do
      name = "ctx-#{System.unique_integer([:positive])}"

      assert {:ok, {:ok, ^name}} =
               VllmBridge.with_context({@diag, "recorder"}, [name], %{}, [pool_name: @remote], fn
                 ^name -> diag("get_var", [], [])
               end)

      {:ok, log} = diag("exit_log", [], pool_name: @remote)
      assert %{"name" => ^name, "type" => nil} = List.last(log)

      VllmBridge.with_session(
        fn s ->
          assert {:ok, {%Ref{node: ^b} = handle, "e2"}} =
                   VllmBridge.enter({@diag, "recorder"}, ["e2"], %{}, session_id: s)

          assert {:ok, "e2"} = diag("get_var", [], [])
          assert {:ok, false} = VllmBridge.exit(handle)
          assert {:ok, nil} = diag("get_var", [], [])
        end,
        pool_name: @remote
      )
    end
  end

  describe "cancel" do
    test "a timeout cancels the call in the remote worker", %{b: b} do
      [os_pid] = os_pids_on(b, @remote)

      assert {:error, %Error{type: :timeout}} =
               diag("sleep", [60.0], pool_name: @remote, timeout: 300)

      # Had the sleep gone on, this call (on a worker of one) would wait behind it for a
      # minute, past its own timeout.
      assert {:ok, 3} = diag("add", [1, 2], pool_name: @remote, timeout: 20_000)
      assert os_pids_on(b, @remote) == [os_pid]
    end

    test "a remote stream past its timeout raises :timeout and frees its worker", %{b: b} do
      {:ok, s} =
        VllmBridge.stream({@diag, "count"}, [5, 60.0], %{}, pool_name: @remote, timeout: 300)

      assert_raise Error, ~r/timeout/, fn -> Enum.to_list(s) end
      wait_until(fn -> remote_load(b, @remote) == 0 end)
      assert {:ok, 3} = diag("add", [1, 2], pool_name: @remote, timeout: 20_000)
    end

    test "an enter past its timeout on the peer leaves nothing entered" do
      VllmBridge.with_session(
        fn s ->
          assert {:error, %Error{type: :timeout, message: m}} =
                   VllmBridge.enter({@diag, "recorder"}, ["slow", false, 2.0], %{},
                     session_id: s,
                     timeout: 300
                   )

          assert m =~ "the context is not left entered"
          # Runs after the __enter__ (the worker runs a session's requests in order), and
          # finds it exited again.
          assert {:ok, nil} = diag("get_var", [], timeout: 30_000)
        end,
        pool_name: @remote
      )
    end

    test "halting while the proxy waits for a slow chunk cancels the generator there",
         %{b: b} do
      {:ok, _} = diag("exit_log", [true], pool_name: @remote)
      name = "slow-#{System.unique_integer([:positive])}"
      # A chunk every 3 s: the halt comes while the proxy waits for the second, so the
      # watcher kills it a second later and the worker cancels the generator.
      {:ok, s} = VllmBridge.stream({@diag, "count"}, [5, 3.0, name], %{}, pool_name: @remote)
      assert Enum.take(s, 1) == [0]

      await_cancelled_remotely(b, name)
    end

    # A remote request's proxy is spawned asynchronously (Remote.spawn_proxy/3): with
    # :erlang.spawn_opt/5 the caller blocked until the stopped node ran again (10 s here,
    # the freeze's limit; up to net_ticktime if it never does) instead of answering at its
    # deadline + 2 s. (That the request then never runs there:
    # test/distribution/abandoned_request_test.exs.)
    test "a node that stops answering: :timeout after the deadline and the margin, then it serves again",
         %{b: b} do
      {result, stopped?} =
        while_frozen(b, fn -> diag("add", [1, 2], pool_name: @remote, timeout: 500) end)

      # Answered while the peer was still stopped (10 s is far past 500 ms + 2 s).
      assert stopped?, "answered only once the peer ran again"
      assert {:error, %Error{type: :timeout, message: m}} = result
      assert m =~ "on node #{inspect(b)}" and m =~ "within its timeout", m
      assert {:ok, 3} = diag("add", [1, 2], pool_name: @remote, timeout: 20_000)
      # Whatever the peer sent after the timeout (its proxy's DOWN, once it gave up
      # waiting for its go) did not reach this process: the alias and the monitor were
      # dropped.
      wait_until(fn -> proxies_on(b) == [] end, 30_000, "no proxy left on the peer")
      assert {:ok, 3} = diag("add", [1, 2], pool_name: @remote, timeout: 20_000)
      Process.sleep(200)
      assert {:messages, []} = Process.info(self(), :messages)
    end

    test "a caller that is shut down cancels its remote call", %{b: b} do
      wait_until(fn -> remote_load(b, @remote) == 0 end, 30_000, "the peer's worker idle")
      task = Task.async(fn -> diag("sleep", [60.0], pool_name: @remote, timeout: 120_000) end)

      wait_until(
        fn -> remote_load(b, @remote) == 1 end,
        30_000,
        "the call in the peer's worker"
      )

      Task.shutdown(task, :brutal_kill)
      wait_until(fn -> remote_load(b, @remote) == 0 end)
      assert {:ok, 3} = diag("add", [1, 2], pool_name: @remote, timeout: 20_000)
    end
  end
end
