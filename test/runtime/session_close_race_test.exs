defmodule VllmBridge.Runtime.SessionCloseRaceTest do
  @moduledoc """
  A session that closes (`Session.close/2`, or its owner's death) while calls of it wait
  in the pool's queue for its worker: the close reaches the worker first, and a call
  written after it would make a fresh session of that id there (the worker makes a
  session on first use), holding its references and entered contexts with nothing left
  on the Elixir side to ever close it. Such a call is refused instead, and the worker
  holds nothing of the session afterwards. Real workers, one worker with one slot, so
  that one `hold/1` makes every session call queue.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Session, Worker}
  alias VllmBridge.Pool.{Directory, Slots}

  @pool :rt_close_race

  # Two workers, for a session id opened again on the other worker.
  @pool2 :rt_close_race2

  setup_all do
    start_pool!(@pool, size: 1, max_in_flight: 1, queue_size: 64)
    start_pool!(@pool2, size: 2, max_in_flight: 1, queue_size: 64)
    :ok
  end

  setup do
    {[w], meta} = await_idle!(@pool)
    # The worker's default session exists (hold/1's stream runs in it), so that the count
    # of sessions before and after a race is that of the sessions opened by the tests.
    {:ok, 2} = diag("add", [1, 1], pool_name: @pool)
    wait_until(fn -> status(w)["refs"] == 0 end)
    %{w: w, meta: meta}
  end

  defp status(w) do
    {:ok, st} = Worker.ping(w.pid)
    st
  end

  defp diag(fun, args, opts),
    do: VllmBridge.call({"vllm_bridge.bridge.diag", fun}, args, %{}, opts)

  # A stream of the session, read whole: its chunks, or the error it raised.
  defp read_stream(id) do
    {:ok, st} = VllmBridge.stream({"vllm_bridge.bridge.diag", "count"}, [3], %{}, session_id: id)
    {:ok, Enum.to_list(st)}
  rescue
    e in Error -> {:error, e}
  end

  # Session requests of several kinds that each leave state in the session: a
  # reference, an entered context, a context variable, a reference inside a list, and
  # (the session itself) a stream.
  defp leaving_state(n, id) do
    [
      fn -> diag("opaque", [n], session_id: id) end,
      fn ->
        VllmBridge.enter({"vllm_bridge.bridge.diag", "recorder"}, ["r#{n}"], %{}, session_id: id)
      end,
      fn -> diag("set_var", [n], session_id: id) end,
      fn -> diag("echo", [[n]], session_id: id) end,
      fn -> read_stream(id) end
    ]
    |> Enum.at(rem(n, 5))
  end

  # `closing` closes the session `s` (the close is sent while the worker is held): once
  # the worker is let go, every queued call of `s` is answered, none leaves state.
  defp race(w, meta, s, n_waiters, closing) do
    sessions_before = status(w)["sessions"]
    held = hold(pool_name: @pool)

    waiters =
      for n <- 1..n_waiters do
        t = Task.async(leaving_state(n, s.id))
        wait_until(fn -> Slots.waiting(meta) == n end)
        t
      end

    closer = closing.()
    # The close is in the worker's table (written to Python, queued behind the hold).
    wait_until(fn -> Worker.in_flight(w.pid) == 2 end)
    assert :released = unhold(held)
    close_result = if closer, do: Task.await(closer, 30_000), else: :ok

    results = Enum.map(waiters, &Task.await(&1, 30_000))

    for r <- results do
      assert {:error, %Error{type: :bad_argument, message: msg}} = r
      assert msg =~ s.id and msg =~ "closed"
    end

    # Nothing of the session is left on the worker.
    wait_until(fn -> Worker.in_flight(w.pid) == 0 end)
    st = status(w)
    assert st["refs"] == 0
    assert st["sessions"] == sessions_before
    close_result
  end

  test "a call queued for the session's worker when Session.close runs is refused, leaving nothing",
       %{w: w, meta: meta} do
    for n_waiters <- [1, 5] do
      {:ok, s} = Session.open(pool_name: @pool)
      closer = fn -> Task.async(fn -> Session.close(s, 30_000) end) end
      assert :ok = race(w, meta, s, n_waiters, closer)
    end
  end

  test "a call queued when the session's owner dies is refused, leaving nothing",
       %{w: w, meta: meta} do
    owner = spawn(fn -> receive(do: (:stop -> :ok)) end)
    {:ok, s} = Session.open(pool_name: @pool, owner: owner)

    race(w, meta, s, 5, fn ->
      send(owner, :stop)
      nil
    end)
  end

  test "a call queued for a closed session is refused when its id is opened again elsewhere" do
    {ws, meta} = await_idle!(@pool2)
    id = "race-reopened-#{System.unique_integer([:positive])}"
    {:ok, old} = Session.open(pool_name: @pool2, worker: 0, id: id)
    held = hold(pool_name: @pool2, session_id: id)

    waiter = Task.async(fn -> diag("opaque", [1], session_id: id) end)
    wait_until(fn -> Slots.waiting(meta) == 1 end)
    closer = Task.async(fn -> Session.close(old, 30_000) end)
    wait_until(fn -> Worker.in_flight(hd(ws).pid) == 2 end)

    # The same id, now on the other worker.
    {:ok, new} = Session.open(pool_name: @pool2, worker: 1, id: id)
    assert :released = unhold(held)
    assert :ok = Task.await(closer, 30_000)

    # The call was routed for the old session: refused, not run on worker 0 in a session
    # that the new one's close would never reach.
    assert {:error, %Error{type: :bad_argument, message: msg}} = Task.await(waiter, 30_000)
    assert msg =~ id and msg =~ "closed"

    assert {:ok, %VllmBridge.Ref{}} = diag("opaque", [2], session_id: new)
    assert :ok = Session.close(new)

    for w <- ws do
      wait_until(fn -> Worker.in_flight(w.pid) == 0 end)
      assert status(w)["refs"] == 0
    end
  end

  test "a :hint call queued when its session closes, then granted another worker, leaves no trace" do
    {[w0, _] = ws, meta} = await_idle!(@pool2)
    {:ok, s} = Session.open(pool_name: @pool2, worker: 0)
    home = hold(pool_name: @pool2, session_id: s.id)
    away = hold(pool_name: @pool2)
    assert Slots.load(meta, 0) == 1 and Slots.load(meta, 1) == 1

    waiter = Task.async(fn -> diag("opaque", [1], session_id: s.id, affinity: :hint) end)
    wait_until(fn -> Slots.waiting(meta) == 1 end)
    closer = Task.async(fn -> Session.close(s, 30_000) end)
    wait_until(fn -> Worker.in_flight(w0.pid) == 2 end)

    # Worker 1 frees first: the queue grants it to the :hint call.
    assert :released = unhold(away)
    assert {:error, %Error{type: :bad_argument}} = Task.await(waiter, 30_000)
    assert :released = unhold(home)
    assert :ok = Task.await(closer, 30_000)

    # No row of the session is left in the directory (a `:touch` row would send a close
    # for it to worker 1 whenever a session of that id closes again), and neither worker
    # holds anything of it.
    assert :ets.match_object(Directory.table(), {{:_, s.id}, :_}) == []
    assert :ets.match_object(Directory.table(), {{:touch, s.id, :_, :_}, :_}) == []

    for w <- ws do
      wait_until(fn -> Worker.in_flight(w.pid) == 0 end)
      assert status(w)["refs"] == 0
    end

    assert Slots.load(meta, 0) == 0 and Slots.load(meta, 1) == 0
  end

  test "a reference of a closed session is refused once its id is open again on another worker" do
    {[w0, _] = ws, _meta} = await_idle!(@pool2)
    id = "race-ref-reopened-#{System.unique_integer([:positive])}"
    {:ok, old} = Session.open(pool_name: @pool2, worker: 0, id: id)
    {:ok, ref} = diag("opaque", [1], session_id: id)

    {:ok, {handle, _}} =
      VllmBridge.enter({"vllm_bridge.bridge.diag", "recorder"}, ["x"], %{}, session_id: id)

    :ok = Session.close(old)
    sessions_before = status(w0)["sessions"]

    {:ok, new} = Session.open(pool_name: @pool2, worker: 1, id: id)

    # Bound to worker 0, where no session of that id lives any more: refused by name,
    # not sent (which would make a session of that id on worker 0 that the new one's
    # close never reaches).
    for result <- [
          VllmBridge.call({ref, "bump"}, [], %{}),
          VllmBridge.call({ref, "bump"}, [], %{}, session_id: id),
          VllmBridge.exit(handle)
        ] do
      assert {:error, %Error{type: :bad_argument, message: msg}} = result
      assert msg =~ id and msg =~ "closed"
    end

    assert status(w0)["sessions"] == sessions_before
    assert :ok = Session.close(new)

    for w <- ws do
      wait_until(fn -> Worker.in_flight(w.pid) == 0 end)
      assert status(w)["refs"] == 0
    end

    assert status(w0)["sessions"] == sessions_before
  end

  test "a call on a reference, queued while its session closes and its id opens elsewhere, is refused" do
    # (The route's check passed when the call was made; the worker's, as it writes it,
    # must ask for the session that made the reference, not only for one of its id.)
    {[w0, _] = ws, meta} = await_idle!(@pool2)
    id = "race-ref-queued-#{System.unique_integer([:positive])}"
    {:ok, old} = Session.open(pool_name: @pool2, worker: 0, id: id)
    {:ok, ref} = diag("opaque", [1], session_id: id)
    held = hold(pool_name: @pool2, session_id: id)
    sessions_with = status(w0)["sessions"]
    waiter = Task.async(fn -> VllmBridge.call({ref, "bump"}, [], %{}) end)
    wait_until(fn -> Slots.waiting(meta) == 1 end)
    closer = Task.async(fn -> Session.close(old, 30_000) end)
    # The close is in worker 0's table (behind the hold), the session forgotten here.
    wait_until(fn -> Worker.in_flight(w0.pid) == 2 end)
    {:ok, new} = Session.open(pool_name: @pool2, worker: 1, id: id)
    assert :released = unhold(held)
    assert :ok = Task.await(closer, 30_000)

    assert {:error, %Error{type: :bad_argument, message: msg}} = Task.await(waiter, 30_000)
    assert msg =~ id and msg =~ "closed"
    assert :ok = Session.close(new)

    for w <- ws, do: wait_until(fn -> Worker.in_flight(w.pid) == 0 end)
    # Worker 0 holds one session fewer than while the old one was open: none of that id.
    assert status(w0)["sessions"] == sessions_with - 1
    assert status(w0)["refs"] == 0
  end

  test "a call on a reference that names another session is refused by name, leaving no session" do
    {[w0, _] = ws, _meta} = await_idle!(@pool2)
    a = "race-ref-a-#{System.unique_integer([:positive])}"
    {:ok, sa} = Session.open(pool_name: @pool2, worker: 0, id: a)
    {:ok, ref} = diag("opaque", [1], session_id: a)
    {:ok, sb} = Session.open(pool_name: @pool2, worker: 1)
    sessions_before = status(w0)["sessions"]

    for opts <- [[session_id: sb.id], [session_id: sb.id, affinity: :strict_fail_fast]] do
      assert {:error, %Error{type: :bad_argument, message: msg}} =
               VllmBridge.get({ref, "value"}, opts)

      assert msg =~ "belongs to session #{inspect(a)}, not to session #{inspect(sb.id)}"
    end

    # Neither session of that id was made on the reference's worker.
    assert status(w0)["sessions"] == sessions_before
    assert {:ok, 1} = VllmBridge.get({ref, "value"}, session_id: a)
    :ok = Session.close(sa)
    :ok = Session.close(sb)
    for w <- ws, do: wait_until(fn -> Worker.in_flight(w.pid) == 0 end)
  end
end
