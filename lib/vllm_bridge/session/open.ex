defmodule VllmBridge.Session.Open do
  @moduledoc false
  # Whether a request of a session may still run: the checks made where a request that
  # waited (in the pool's queue, for room on its worker) is written to the port
  # (VllmBridge.Worker.Calls.admit/3) and where a `:hint` call lands on another worker
  # (VllmBridge.Call.Route). The worker's Python side makes a session of an id on its
  # first use, so a request of a session that closed, run after the close, would bring
  # the session back on the worker with nothing left to close it (docs/PROTOCOL.md,
  # "Sessions"). A session is forgotten (its rows gone from VllmBridge.Pool.Directory)
  # before its `close` is sent: a request written after the close finds it forgotten,
  # and one that finds it open runs before the close.

  alias VllmBridge.{Error, Session}
  alias VllmBridge.Pool.Directory

  @typedoc """
  What a request must find open: a session as routed (that very struct), a session id,
  or `{:ref, id, instance, index}` for a request on a reference of session `id` made on
  the worker process `instance`, index `index` (`ref_open?/3`).
  """
  @type which ::
          Session.t()
          | String.t()
          | {:ref, String.t(), String.t(), non_neg_integer()}

  @doc false
  @spec still_open?(which()) :: boolean()
  def still_open?(%Session{id: id} = s),
    do: :ets.lookup(Directory.table(), {:session, id}) == [{{:session, id}, s}]

  def still_open?(id) when is_binary(id), do: :ets.member(Directory.table(), {:session, id})
  def still_open?({:ref, id, instance, index}), do: ref_open?(id, instance, index)

  @doc false
  # Whether a reference of session `id`, made on the worker process `instance` (index
  # `index` of its pool), may still be used: the session open under `id` is the one that
  # made it, i.e. it ran on that worker process (its home, or a `:hint` call of it ran
  # there: its touch row). A session closed and opened again under the id elsewhere is
  # another: the request would make a session of that id on the reference's worker that
  # the open one's close never reaches.
  @spec ref_open?(String.t(), String.t(), non_neg_integer()) :: boolean()
  def ref_open?(id, instance, index) do
    table = Directory.table()

    case :ets.lookup(table, {:session, id}) do
      [{_, %Session{instance: ^instance}}] ->
        true

      [{_, s}] ->
        :ets.lookup(table, {:touch, id, index, s}) == [{{:touch, id, index, s}, instance}]

      [] ->
        false
    end
  end

  @doc false
  # The error of a request of a session that its worker was about to write after the
  # session closed (`what`: its `{kind, target}`, or nil).
  @spec closed_meanwhile(which(), term()) :: Error.t()
  def closed_meanwhile(%Session{id: id}, what), do: closed_meanwhile(id, what)

  def closed_meanwhile({:ref, id, _instance, _index}, what) do
    Error.new(
      :bad_argument,
      "session #{inspect(id)}, which made the reference this request" <>
        "#{VllmBridge.Worker.Calls.describe(what)} runs on, closed while the request " <>
        "waited (for room on its worker); a session of that id open now is another, and " <>
        "the request is not run (it would bring the closed one back on the reference's " <>
        "worker, with nothing left to close it)"
    )
  end

  def closed_meanwhile(id, what) do
    Error.new(
      :bad_argument,
      "session #{inspect(id)} is closed: this request#{VllmBridge.Worker.Calls.describe(what)} " <>
        "of it waited (for room on its worker) while the session closed, and is not run " <>
        "(it would bring the session back on the worker, with nothing left to close it)"
    )
  end

  @doc false
  # A :hint call of session `s` runs on worker `index` (process `instance`), not its
  # home: remembered (a touch row), so that the session's close reaches it there too. A
  # session that closed meanwhile (the call waited in the pool's queue) has had its rows
  # removed: the row is taken back (else it would outlive the session, and send a `close`
  # to that worker whenever a session of that id closes again) and the call is refused.
  # Inserted before the look, so that a close that removes the rows after it finds this
  # one (a row of an earlier instance of that worker is replaced, as the close must
  # reach the new one). A row names its session (the struct, unique to one open: its
  # `token`), not only its id: a row of a closed session is of no use to anybody, so the
  # take-back removes it whoever made it, and never removes, nor does the insert
  # replace, the row of a session opened again under the id on the same worker (whose
  # close would then miss that worker).
  @spec touched(Session.t(), non_neg_integer(), String.t()) :: :ok | {:error, Error.t()}
  def touched(%Session{id: id} = s, index, instance) do
    table = Directory.table()
    row = {{:touch, id, index, s}, instance}
    :ets.insert(table, row)

    if still_open?(s) do
      :ok
    else
      :ets.delete_object(table, row)
      {:error, closed_meanwhile(s, nil)}
    end
  end
end
