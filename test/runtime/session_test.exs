defmodule VllmBridge.Runtime.SessionTest do
  @moduledoc """
  Sessions against real workers: open/close, a session on a chosen worker, per-session
  Python contexts, references released on close (also one that times out) and on owner
  death, `:session_lost` after the session's worker restarted, and bad session options.
  Affinity: session_affinity_test.exs.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Ref, Session, Worker}
  alias VllmBridge.Pool.Directory

  # Two workers, one call in flight each: one hold/1 fills a worker.
  @pool :rt_sess

  setup_all do
    start_pool!(@pool, size: 2, max_in_flight: 1, queue_size: 8)
    :ok
  end

  setup do
    {ws, meta} = await_idle!(@pool)

    # The sessions of earlier tests are closed (their owner, the test process, is gone;
    # the close reaches the worker asynchronously): no reference is held any more.
    wait_until(fn -> Enum.all?(0..1, &(status(ws, &1)["refs"] == 0)) end)

    %{ws: ws, meta: meta}
  end

  defp diag(fun, args, opts),
    do: VllmBridge.call({"vllm_bridge.bridge.diag", fun}, args, %{}, opts)

  defp open!(opts \\ []) do
    {:ok, s} = Session.open([pool_name: @pool] ++ opts)
    on_exit(fn -> Session.close(s) end)
    s
  end

  defp status(ws, i) do
    {:ok, st} = Worker.ping(Enum.at(ws, i).pid)
    st
  end

  defp elem_or_nil(nil, _i), do: nil
  defp elem_or_nil(tuple, i), do: elem(tuple, i)

  defp os_pid_of(s), do: fn -> diag("info", [], session_id: s.id) end

  test "open, use and close a session", %{ws: ws} do
    s = open!()
    assert %Session{pool: @pool, owner: owner, id: "s-" <> _} = s
    assert owner == self()
    assert {:ok, ^s} = Session.lookup(s.id)
    assert {:ok, 3} = diag("add", [1, 2], session_id: s.id)
    # The struct works as well as its id.
    assert {:ok, 5} = diag("add", [2, 3], session_id: s)
    assert status(ws, s.worker)["sessions"] >= 1

    assert :ok = Session.close(s)
    assert {:error, %Error{type: :bad_argument, message: msg}} = Session.lookup(s.id)
    assert msg =~ s.id
    assert {:error, %Error{type: :bad_argument}} = diag("add", [1, 2], session_id: s.id)
    assert {:error, %Error{type: :bad_argument, message: msg}} = Session.close(s)
    assert msg =~ "unknown session"
  end

  test "a session on a chosen worker runs there (a DP rank)", %{ws: ws} do
    for i <- 0..1 do
      s = open!(worker: i)
      assert s.worker == i
      assert s.instance == Enum.at(ws, i).instance
      os_pid = Enum.at(ws, i).os_pid
      for _ <- 1..3, do: assert({:ok, %{"pid" => ^os_pid}} = os_pid_of(s).())
    end
  end

  test "with_session opens, passes and always closes" do
    me = self()

    assert {:ok, 7} =
             VllmBridge.with_session(
               fn s ->
                 send(me, {:session, s.id})
                 diag("add", [3, 4], session_id: s.id)
               end,
               pool_name: @pool
             )

    assert_received {:session, id}
    assert {:error, %Error{type: :bad_argument}} = Session.lookup(id)

    assert_raise RuntimeError, fn ->
      VllmBridge.with_session(
        fn s ->
          send(me, {:session, s.id})
          raise "boom"
        end,
        pool_name: @pool
      )
    end

    assert_received {:session, id2}
    assert {:error, %Error{type: :bad_argument}} = Session.lookup(id2)
  end

  test "two sessions on one worker each have their own Python context" do
    a = open!(worker: 0)
    b = open!(worker: 0)

    assert {:ok, nil} = diag("set_var", ["a"], session_id: a.id)
    assert {:ok, nil} = diag("set_var", ["b"], session_id: b.id)
    assert {:ok, "a"} = diag("get_var", [], session_id: a.id)
    assert {:ok, "b"} = diag("get_var", [], session_id: b.id)
    assert {:ok, "a"} = diag("set_var", ["a2"], session_id: a.id)
    assert {:ok, "b"} = diag("get_var", [], session_id: b.id)

    # Calls outside any session see neither.
    VllmBridge.with_session(
      fn c -> assert {:ok, nil} = diag("get_var", [], session_id: c.id) end,
      pool_name: @pool,
      worker: 0
    )

    # A session closed and opened again under the same id starts from a fresh context.
    :ok = Session.close(a)
    {:ok, a2} = Session.open(pool_name: @pool, worker: 0, id: a.id)
    assert {:ok, nil} = diag("get_var", [], session_id: a2.id)
    :ok = Session.close(a2)
  end

  test "a reference belongs to its session: refused in another, usable in its own" do
    a = open!(worker: 0)
    b = open!(worker: 0)
    {:ok, %Ref{session: sid} = ref} = diag("opaque", [41], session_id: a.id)
    assert sid == a.id

    assert {:ok, 42} = VllmBridge.call({ref, "bump"}, [], %{}, session_id: a.id)
    # Without session_id, a call on a reference runs in the reference's session.
    assert {:ok, 43} = VllmBridge.call({ref, "bump"})

    assert {:error, %Error{type: :bad_argument, message: msg}} =
             VllmBridge.call({ref, "bump"}, [], %{}, session_id: b.id)

    assert msg =~ a.id
    assert {:ok, 44} = VllmBridge.call({ref, "bump"}, [], %{}, session_id: a.id)
  end

  test "closing a session releases its references", %{ws: ws} do
    s = open!(worker: 1)
    base = status(ws, 1)["refs"]
    refs = for v <- 1..3, do: elem(diag("opaque", [v], session_id: s.id), 1)
    assert Enum.all?(refs, &match?(%Ref{}, &1))
    assert status(ws, 1)["refs"] == base + 3

    # An explicit release counts what it dropped; a second release of it counts nothing.
    assert {:ok, 1} = VllmBridge.release(hd(refs))
    assert {:ok, 0} = VllmBridge.release(hd(refs))
    assert status(ws, 1)["refs"] == base + 2

    sessions = status(ws, 1)["sessions"]
    :ok = Session.close(s)
    assert status(ws, 1)["refs"] == base
    assert status(ws, 1)["sessions"] == sessions - 1

    # A reference of the closed session is refused, naming the session, and creates no
    # state on the worker.
    assert {:error, %Error{type: :bad_argument, message: msg}} =
             VllmBridge.call({List.last(refs), "bump"})

    assert msg =~ s.id
    assert {:error, %Error{type: :bad_argument}} = VllmBridge.release(List.last(refs))
    assert status(ws, 1)["sessions"] == sessions - 1
  end

  test "a close that times out behind a long call still runs: the state is released",
       %{ws: ws} do
    s = open!(worker: 0)
    {:ok, %Ref{}} = diag("opaque", [1], session_id: s.id)
    assert status(ws, 0)["refs"] == 1

    # Another session's long call (a stream, until unhold) occupies the worker's Python
    # thread.
    busy = hold(pool_name: @pool, session_id: open!(worker: 0).id)
    wait_until(fn -> is_integer(status(ws, 0)["running"]) end)

    assert {:error, %Error{type: :timeout, message: msg}} = Session.close(s, 100)
    assert msg =~ "still runs"
    # Forgotten here at once; released there when the worker gets to it.
    assert {:error, %Error{type: :bad_argument}} = Session.lookup(s.id)
    assert status(ws, 0)["refs"] == 1
    assert status(ws, 0)["queued"] == 1

    unhold(busy)
    wait_until(fn -> status(ws, 0)["refs"] == 0 end)
  end

  test "a close whose caller dies while it waits still runs", %{ws: ws} do
    owner = spawn(fn -> receive do: (:never -> :ok) end)
    on_exit(fn -> Process.exit(owner, :kill) end)
    {:ok, s} = Session.open(pool_name: @pool, worker: 1, owner: owner)
    {:ok, %Ref{}} = diag("opaque", [1], session_id: s.id)
    busy = hold(pool_name: @pool, session_id: open!(worker: 1).id)
    wait_until(fn -> is_integer(status(ws, 1)["running"]) end)

    closer = spawn(fn -> Session.close(s, 60_000) end)
    wait_until(fn -> status(ws, 1)["queued"] == 1 end)
    Process.exit(closer, :kill)

    unhold(busy)
    wait_until(fn -> status(ws, 1)["refs"] == 0 end)
  end

  test "a session whose owner dies is closed and its references released", %{ws: ws} do
    base = status(ws, 0)["refs"]
    me = self()

    owner =
      spawn(fn ->
        {:ok, s} = Session.open(pool_name: @pool, worker: 0)
        {:ok, ref} = diag("opaque", [1], session_id: s.id)
        send(me, {:opened, s, ref})
        receive do: (:die -> exit(:killed_by_test))
      end)

    assert_receive {:opened, s, ref}, 30_000
    assert status(ws, 0)["refs"] == base + 1
    send(owner, :die)

    wait_until(fn -> match?({:error, _}, Session.lookup(s.id)) end)
    wait_until(fn -> status(ws, 0)["refs"] == base end)
    assert {:error, %Error{type: :bad_argument}} = VllmBridge.call({ref, "bump"})
  end

  test "owner: another process whose death closes the session", %{ws: ws} do
    base = status(ws, 1)["refs"]
    owner = spawn(fn -> receive do: (:die -> :ok) end)
    {:ok, s} = Session.open(pool_name: @pool, worker: 1, owner: owner)
    assert s.owner == owner
    {:ok, %Ref{}} = diag("opaque", [1], session_id: s.id)
    assert status(ws, 1)["refs"] == base + 1

    send(owner, :die)
    wait_until(fn -> match?({:error, _}, Session.lookup(s.id)) end)
    wait_until(fn -> status(ws, 1)["refs"] == base end)
  end

  test "after the session's worker restarts: :session_lost for the session and its refs",
       %{ws: ws} do
    s = open!(worker: 0)
    other = open!(worker: 1)
    {:ok, ref} = diag("opaque", [1], session_id: s.id)
    {:ok, other_ref} = diag("opaque", [1], session_id: other.id)
    %{os_pid: os_pid, instance: old} = Enum.at(ws, 0)

    System.cmd("kill", ["-9", "#{os_pid}"])
    # Once the runtime has seen the process go, whether the worker is still restarting
    # or serves again, the session is lost. (A call sent before that is in flight when
    # the process dies: :worker_exit, as for any call.)
    wait_until(fn -> Directory.worker(@pool, 0) |> elem_or_nil(1) != old end)

    assert {:error, %Error{type: :session_lost, message: msg}} =
             diag("add", [1, 1], session_id: s.id)

    assert msg =~ s.id
    new_ws = workers!(@pool)
    assert Enum.at(new_ws, 0).instance != old

    assert {:error, %Error{type: :session_lost}} = diag("add", [1, 1], session_id: s.id)
    assert {:error, %Error{type: :session_lost}} = VllmBridge.call({ref, "bump"})

    assert {:error, %Error{type: :session_lost}} =
             VllmBridge.call({ref, "bump"}, [], %{}, session_id: s.id)

    assert {:error, %Error{type: :session_lost}} = VllmBridge.release(ref)

    assert {:error, %Error{type: :session_lost}} =
             diag("add", [1, 1], session_id: s.id, affinity: :hint)

    # The other worker's session is untouched.
    assert {:ok, 2} = VllmBridge.call({other_ref, "bump"}, [], %{}, session_id: other.id)

    # Closing a lost session only forgets it; a new session on that worker works.
    assert :ok = Session.close(s)
    s2 = open!(worker: 0)
    assert {:ok, 2} = diag("add", [1, 1], session_id: s2.id)
  end

  describe "bad session options and ids" do
    test "Session.open refuses bad options by name" do
      assert {:error, %Error{type: :bad_argument, message: m}} =
               Session.open(pool_name: @pool, wroker: 1)

      assert m =~ ":wroker"

      assert {:error, %Error{type: :bad_argument, message: m}} =
               Session.open(pool_name: @pool, worker: 2)

      assert m =~ "got 2" and m =~ "0..1"

      assert {:error, %Error{type: :bad_argument, message: m}} =
               Session.open(pool_name: @pool, worker: :first)

      assert m =~ ":first"

      assert {:error, %Error{type: :bad_argument, message: m}} =
               Session.open(pool_name: @pool, id: "")

      assert m =~ "non-empty string"

      assert {:error, %Error{type: :bad_argument, message: m}} =
               Session.open(pool_name: @pool, id: :s1)

      assert m =~ ":s1"

      assert {:error, %Error{type: :bad_argument, message: m}} =
               Session.open(pool_name: @pool, owner: "me")

      assert m =~ "\"me\""

      assert {:error, %Error{type: :bad_argument, message: m}} = Session.open(:nope)
      assert m =~ ":nope"

      assert {:error, %Error{type: :bad_argument, message: m}} = Session.open(pool_name: :nope)
      assert m =~ ":nope"
    end

    test "an id already open is refused" do
      s = open!()

      assert {:error, %Error{type: :bad_argument, message: m}} =
               Session.open(pool_name: @pool, id: s.id)

      assert m =~ s.id and m =~ "already open"
    end

    test "bad session ids in runtime options are refused by name" do
      assert {:error, %Error{type: :bad_argument, message: m}} =
               diag("add", [1, 1], session_id: 42)

      assert m =~ "session_id" and m =~ "42"

      assert {:error, %Error{type: :bad_argument, message: m}} =
               diag("add", [1, 1], session_id: "no-such-session")

      assert m =~ "no-such-session"

      assert {:error, %Error{type: :bad_argument, message: m}} = Session.close(42)
      assert m =~ "42"
      assert {:error, %Error{type: :bad_argument}} = Session.close("no-such-session")
    end

    test "a pool_name that differs from the session's pool is refused" do
      s = open!()

      assert {:error, %Error{type: :bad_argument, message: m}} =
               diag("add", [1, 1], session_id: s.id, pool_name: :other)

      assert m =~ ":other" and m =~ inspect(@pool)
      assert {:ok, 2} = diag("add", [1, 1], session_id: s.id, pool_name: @pool)
    end
  end
end
