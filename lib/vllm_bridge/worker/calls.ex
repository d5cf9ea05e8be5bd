defmodule VllmBridge.Worker.Calls do
  @moduledoc false
  # The table of calls in flight of one worker process (VllmBridge.Worker), and what
  # happens to a request from its arrival: admitted or refused (`admit/6`), its reply
  # reaching its caller (`finish/5`), its caller giving up or dying (`cancel/3`,
  # `abandoned/3`), overdue or still running after its cancel (`sweep/3`,
  # `overstayed/3`), or the worker going down (`fail_all/2`). The worker process owns the
  # port and writes to it; this module keeps the table, answers the callers, gives pool
  # slots back and keeps the pool's slot count right (`sweep/3`).
  #
  # An entry is a `VllmBridge.Worker.Calls.Entry`.
  #
  # Callers whose death must cancel their calls are monitored once per caller while they
  # call (`callers`: pid => {monitor, live calls}). Which callers keep their monitor between
  # calls is chosen by what each costs the worker process
  # (bench/results/erlport-round-trip-continued.md, "The worker process and the Python
  # worker, measured"): a caller's first call ends with a demonitor, as a caller of one call
  # (a process per request, a `Task` per call) would otherwise send a :DOWN to this process
  # when it dies; a caller seen calling again within the sweep's second (`recent`) keeps its
  # monitor while it has no call in flight, so one that calls again and again costs no
  # monitor and no demonitor per call, and is let go at the next sweep (`sweep/3`) once
  # idle; its death meanwhile finds nothing to cancel.

  alias VllmBridge.Error
  alias VllmBridge.Session.Open
  alias VllmBridge.Call.Wire
  alias VllmBridge.Pool.Slots
  alias VllmBridge.Worker.{Messages, Unclaimed}
  alias VllmBridge.Worker.Messages.Submit

  defmodule Entry do
    @moduledoc false
    # One call in flight: `alias`, where its replies go; `holds_slot`, whether it holds
    # a pool slot; `what`, `{kind, target}` or nil (for messages); its `deadline`;
    # `status`, :live (a caller waits on `alias`; `caller`, when set, is the process
    # whose death cancels it, counted in the table's `callers`), :detached (nobody
    # waits) or {:cancelled, since} (cancel sent, `cancel_grace` running).
    defstruct [:alias, :holds_slot, :what, :deadline, :status, :caller]

    @type t :: %__MODULE__{
            alias: reference() | nil,
            holds_slot: boolean(),
            what: {String.t(), term()} | nil,
            deadline: integer() | :infinity,
            status: :live | :detached | {:cancelled, integer()},
            caller: pid() | nil
          }
  end

  # How many callers of one call `recent` holds at most (`unhold/2`).
  @recent_max 256

  defstruct map: %{}, callers: %{}, recent: %{}, arrivals: 0, slot: nil, seen: nil

  @typedoc """
  `map` the calls by id; `callers` the monitored callers, pid => {monitor, how many of
  its calls are live}; `recent` the callers whose monitor went when their call ended,
  since the last sweep; `arrivals` how many were added since the last sweep; `slot`
  the pool's meta and this worker's index (nil for a worker outside a pool); `seen` the
  slot count the last sweep found above what the table holds, with the table empty and
  nothing arriving (see `sweep/3`).
  """
  @type t :: %__MODULE__{
          map: %{optional(non_neg_integer()) => Entry.t()},
          callers: %{optional(pid()) => {reference(), non_neg_integer()}},
          recent: %{optional(pid()) => true},
          arrivals: non_neg_integer(),
          slot: {VllmBridge.Pool.Meta.t(), non_neg_integer()} | nil,
          seen: integer() | nil
        }

  @doc false
  @spec new(VllmBridge.Pool.Meta.t() | nil, non_neg_integer()) :: t()
  def new(nil, _index), do: %__MODULE__{}
  def new(meta, index), do: %__MODULE__{slot: {meta, index}}

  @doc false
  @spec size(t()) :: non_neg_integer()
  def size(%__MODULE__{map: map}), do: map_size(map)

  @doc false
  # Whether a request that just arrived may be written to the port: `{:ok, t}`, or
  # `{:refused, t}` once its caller has been answered (and its slot given back): its
  # id is in use, or its body (`size`, as its caller counted it) is over the frame
  # limit `max`. The limit is checked before a slot is taken on a pool's path
  # (VllmBridge.Call.Route); this catches the others (Worker.call, a session's close, a
  # release) before Python would see a header over its limit and end the stream.
  #
  # A request of a session (`session` set) is refused when the session has closed since
  # its caller routed it (it waited in the pool's queue, say): the session's `close` was
  # written before it, and the worker would make a fresh session of that id for it,
  # holding its references and contexts with nothing left to close them. Checked here,
  # in the process that writes to the port, because a session is forgotten before its
  # `close` is sent: a request written after the close finds it forgotten, and one that
  # finds it open runs before the close. (A session routed as a struct must be that very
  # session: one closed and opened again under its id, perhaps on another worker, is
  # another; a request on a reference must find the session that made the reference,
  # VllmBridge.Session.Open.ref_open?/3.)
  @spec admit(t(), Submit.t(), pos_integer()) :: {:ok, t()} | {:refused, t()}
  def admit(t, %Submit{id: id, size: size, session: session} = s, max) do
    cond do
      Map.has_key?(t.map, id) ->
        refuse(t, s, Error.new(:protocol, "request id #{id} is in use"))

      size > max ->
        refuse(t, s, Wire.too_large(size, max, "max_frame_bytes"))

      session != nil and not Open.still_open?(session) ->
        refuse(t, s, Open.closed_meanwhile(session, s.what))

      true ->
        {:ok, t}
    end
  end

  defp refuse(t, %Submit{alias: alias, holds_slot: holds_slot}, error) do
    if alias, do: Messages.send_reply_error(alias, error)
    if holds_slot, do: release(t)
    {:refused, t}
  end

  @doc false
  # A request admitted (written to the port next, VllmBridge.Worker.Intake): its caller
  # (if any) is monitored, so that a caller that dies has its calls cancelled
  # (`abandoned/3`).
  @spec add(t(), Submit.t()) :: t()
  def add(t, %Submit{id: id, alias: alias, caller: caller} = s) do
    status = if alias || caller, do: :live, else: :detached

    entry = %Entry{
      alias: alias,
      holds_slot: s.holds_slot,
      what: s.what,
      deadline: s.deadline,
      status: status,
      caller: caller
    }

    callers = if caller, do: hold(t.callers, caller), else: t.callers
    %{t | map: Map.put(t.map, id, entry), callers: callers, arrivals: t.arrivals + 1}
  end

  # One more live call of `caller`: monitored the first time it is seen (or seen again
  # after a sweep let it go).
  defp hold(callers, caller) do
    case callers do
      %{^caller => {mon, n}} -> %{callers | caller => {mon, n + 1}}
      _ -> Map.put(callers, caller, {Process.monitor(caller), 1})
    end
  end

  # One live call of `caller` fewer (it ended, or was cancelled). Its last one: the
  # monitor stays when the caller called before since the last sweep (it is likely to call
  # again); otherwise it goes now and the caller is remembered in `recent` (no :flush, a
  # scan of this mailbox: a :DOWN already on its way finds no monitor, `abandoned/3`).
  # `recent` is emptied at each sweep and when it reaches 256 callers (callers of one call
  # each would otherwise fill it): a caller forgotten early only pays one more monitor.
  defp unhold(t, nil), do: t

  defp unhold(t, caller) do
    case t.callers do
      %{^caller => {mon, 1}} ->
        if Map.has_key?(t.recent, caller) do
          %{t | callers: %{t.callers | caller => {mon, 0}}}
        else
          Process.demonitor(mon)
          recent = if map_size(t.recent) >= @recent_max, do: %{}, else: t.recent
          %{t | callers: Map.delete(t.callers, caller), recent: Map.put(recent, caller, true)}
        end

      %{^caller => {mon, n}} when n > 1 ->
        %{t | callers: %{t.callers | caller => {mon, n - 1}}}

      _ ->
        t
    end
  end

  @doc false
  # Each call in flight's `{kind, target}` (nil for messages), by id (for a status).
  @spec targets(t()) :: %{optional(non_neg_integer()) => {String.t(), term()} | nil}
  def targets(%__MODULE__{map: map}), do: Map.new(map, fn {id, e} -> {id, e.what} end)

  @doc false
  # The alias of the caller waiting on call `id`, or nil when nobody waits.
  @spec live(t(), non_neg_integer()) :: reference() | nil
  def live(%__MODULE__{map: map}, id) do
    case map do
      %{^id => %Entry{alias: alias, status: :live}} -> alias
      _ -> nil
    end
  end

  @doc false
  # The process whose death cancels call `id` while it is live (the process its replies
  # go to: it made the alias), or nil (not live, or no such process).
  @spec caller(t(), non_neg_integer()) :: pid() | nil
  def caller(%__MODULE__{map: map}, id) do
    case map do
      %{^id => %Entry{caller: caller, status: :live}} -> caller
      _ -> nil
    end
  end

  @doc false
  # The last frame of call `id` (`tag` :reply or :end): the call leaves the table, its
  # slot comes back, and its caller gets the frame with the worker's `origin` (its frame
  # limit and os pid, VllmBridge.Worker.Messages; or, when nobody waits, the references
  # in it are released and its slots of that worker handed back).
  @spec finish(t(), non_neg_integer(), :reply | :end, binary() | nil, SlotExt.origin()) ::
          t()
  def finish(t, id, tag, bin, origin) do
    case Map.pop(t.map, id) do
      {%Entry{} = e, map} ->
        # The slot first: a caller that has its reply and calls again at once must find
        # the worker idle (`:strict_fail_fast` and `:hint` look for an idle count).
        if e.holds_slot, do: release(t)

        if e.status == :live do
          Messages.send_finish(e.alias, tag, bin, origin)
          unhold(%{t | map: map}, e.caller)
        else
          Unclaimed.drop(bin, origin)
          %{t | map: map}
        end

      {nil, _} ->
        t
    end
  end

  @doc false
  # Gives back the pool slot of a request that is not in the table (refused, or dropped).
  @spec release(t()) :: :ok
  def release(%__MODULE__{slot: nil}), do: :ok
  def release(%__MODULE__{slot: {meta, index}}), do: Slots.release(meta, index)

  @doc false
  # Marks call `id` cancelled at `now` (its caller gave up, died, or it is overdue):
  # `{:cancelled, t}` when it was live (the worker then sends the cancel to Python and
  # starts `cancel_grace`), `:not_live` otherwise.
  @spec cancel(t(), non_neg_integer(), integer()) :: {:cancelled, t()} | :not_live
  def cancel(t, id, now) do
    case t.map do
      %{^id => %Entry{status: :live} = e} ->
        entry = %{e | status: {:cancelled, now}}
        {:cancelled, unhold(%{t | map: Map.put(t.map, id, entry)}, e.caller)}

      _ ->
        :not_live
    end
  end

  @doc false
  # Caller `pid`, monitored by `mon`, died: the ids of its live calls (to cancel), and the
  # table without its monitor. A :DOWN of a monitor already let go (the sweep) finds none.
  @spec abandoned(t(), reference(), pid()) :: {[non_neg_integer()], t()}
  def abandoned(t, mon, pid) do
    case t.callers do
      %{^pid => {^mon, n}} ->
        ids =
          if n == 0,
            do: [],
            else: for({id, %Entry{status: :live, caller: ^pid}} <- t.map, do: id)

        {ids, %{t | callers: Map.delete(t.callers, pid)}}

      _ ->
        {[], t}
    end
  end

  @doc false
  # Call `id`, `grace` ms after its cancel: words that say it is still running (it did
  # not stop when interrupted), or nil when it is gone.
  @spec overstayed(t(), non_neg_integer(), non_neg_integer()) :: String.t() | nil
  def overstayed(%__MODULE__{map: map}, id, grace) do
    case map do
      %{^id => %Entry{what: what, status: {:cancelled, since}}} ->
        "request #{id}#{describe(what)} was still running " <>
          "#{System.monotonic_time(:millisecond) - since} ms after it was cancelled " <>
          "(cancel_grace #{grace} ms: it did not stop when interrupted)"

      _ ->
        nil
    end
  end

  @doc false
  # The periodic sweep: the live calls more than `slack` ms past their deadline at `now`
  # (their caller forgot them: the worker cancels them), and the pool's slot count of
  # this worker set right (`correct/1`).
  @spec sweep(t(), integer(), non_neg_integer()) :: {[non_neg_integer()], t()}
  def sweep(t, now, slack) do
    overdue =
      for {id, %Entry{deadline: deadline, status: :live}} <- t.map,
          is_integer(deadline) and deadline + slack < now,
          do: id

    {overdue, %{t | seen: correct(t), arrivals: 0, callers: let_go(t.callers), recent: %{}}}
  end

  # Callers without a live call are no longer monitored. No :flush (a scan of this
  # mailbox): a :DOWN already on its way finds no monitor in the table (`abandoned/3`).
  defp let_go(callers) do
    :maps.filter(
      fn
        _pid, {mon, 0} ->
          Process.demonitor(mon)
          false

        _pid, _held ->
          true
      end,
      callers
    )
  end

  # The count is the reservations made (by callers, before they send) less the slots
  # given back (here, as replies come in), so it is never below the counted calls in the
  # table: a count below that is wrong (a correction took back a reservation whose request
  # then came after all), and is set right at once. A count above it may be requests on
  # their way, or a reservation left by a caller that died before sending: only a count
  # seen unchanged over a whole sweep, with the table empty and nothing arriving, is
  # taken for a leftover and reset. Returns the count to remember for the next sweep.
  defp correct(%__MODULE__{slot: nil}), do: nil

  defp correct(%__MODULE__{slot: {meta, index}} = t) do
    load = Slots.load(meta, index)
    held = Enum.count(t.map, fn {_id, %Entry{holds_slot: holds_slot}} -> holds_slot end)

    cond do
      # Not serving (a successor's start, or this worker's end): not this sweep's to fix.
      load >= div(Slots.down(), 2) ->
        nil

      load < held ->
        Slots.correct_load(meta, index, load, held)
        nil

      load > 0 and held == 0 and t.arrivals == 0 ->
        if load == t.seen do
          Slots.correct_load(meta, index, load, 0)
          nil
        else
          load
        end

      true ->
        nil
    end
  end

  @doc false
  # The worker goes down: every caller still waiting gets `:worker_exit` with `message`;
  # the table is emptied.
  @spec fail_all(t(), String.t()) :: t()
  def fail_all(t, message) do
    for {_id, %Entry{alias: alias, status: :live}} <- t.map do
      Messages.send_worker_exit(alias, message)
    end

    for {_pid, {mon, _n}} <- t.callers, do: Process.demonitor(mon)
    %{t | map: %{}, callers: %{}, recent: %{}}
  end

  @doc false
  # `what` as words for a message: ` (call {"m", "f"})`, or nothing.
  @spec describe(term()) :: String.t()
  def describe({kind, target}) when is_binary(kind) and is_binary(target),
    do: " (#{kind} #{target})"

  def describe({kind, target}) when is_binary(kind),
    do: " (#{kind} #{inspect(target, limit: 5, printable_limit: 80)})"

  def describe(_), do: ""
end
