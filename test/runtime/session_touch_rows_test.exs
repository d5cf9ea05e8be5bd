defmodule VllmBridge.Runtime.SessionTouchRowsTest do
  @moduledoc """
  The rows that remember the other workers a session's `:hint` calls ran on
  (`VllmBridge.Session.Open.touched/3`) when a session id is closed and opened again: a
  call of the closed session, landing on the same worker as a call of the open one,
  takes its own row back (it is refused) and must leave the open session's row alone,
  also when the two differ only by their token (opened again by the same owner on the
  same worker). Rows named the session only by its id, so that take-back could remove
  the open session's row, and its close then missed that worker. The two sessions' calls race on
  two schedulers; the open session's row must be there after each of its calls.
  Directory rows only (the session manager is not involved: the rows are what it reads
  at a close).
  """
  use ExUnit.Case, async: false

  # On one scheduler the two callers never interleave inside touched/3, and the test
  # would pass on the old rows too.
  if System.schedulers_online() < 2 do
    @moduletag skip: "the race needs two schedulers (#{System.schedulers_online()} online)"
  end

  alias VllmBridge.Session
  alias VllmBridge.Session.Open
  alias VllmBridge.Pool.Directory

  test "a refused call of a closed session never takes the open session's row back" do
    id = "touch-rows-#{System.unique_integer([:positive])}"
    owner = spawn(fn -> Process.sleep(:infinity) end)
    # Opened again on the same worker by the same owner: only its token tells it apart.
    closed = %Session{
      id: id,
      pool: :touch_pool,
      worker: 0,
      instance: "home-1",
      owner: owner,
      token: make_ref()
    }

    open = %Session{closed | token: make_ref()}
    table = Directory.table()
    true = :ets.insert(table, {{:session, id}, open})

    on_exit(fn ->
      :ets.delete(table, {:session, id})
      forget_rows(table, id)
      Process.exit(owner, :kill)
    end)

    # The closed session's calls, back to back, for as long as the open one's run.
    me = self()

    racer =
      spawn_link(fn ->
        send(me, :racing)
        race(closed, me, 0)
      end)

    assert_receive :racing

    for round <- 1..20_000 do
      # Each round the open session's first :hint call on worker 1 (no row of it yet).
      forget_rows(table, id)
      assert :ok = Open.touched(open, 1, "w-1")
      # Its row is there: a reference made on worker 1 may be used, and a close reaches it.
      assert Open.ref_open?(id, "w-1", 1), "round #{round}: the open session's row is gone"
    end

    send(racer, :stop)
    assert_receive {:raced, n}, 10_000
    assert n > 0
  end

  # (Rows as they are now, and as they were, by id alone: the test fails on that code.)
  defp forget_rows(table, id) do
    :ets.match_delete(table, {{:touch, id, :_, :_}, :_})
    :ets.match_delete(table, {{:touch, id, :_}, :_})
  end

  defp race(session, me, n) do
    receive do
      :stop -> send(me, {:raced, n})
    after
      0 ->
        {:error, %VllmBridge.Error{type: :bad_argument}} = Open.touched(session, 1, "w-1")
        race(session, me, n + 1)
    end
  end
end
