defmodule VllmBridge.Worker.Cancel do
  @moduledoc false
  # The calls of a ready worker process (VllmBridge.Worker) that end without their reply:
  # what the worker process does when a caller gives up, dies, or forgets its call, and
  # when a cancelled call does not stop. Apart from VllmBridge.Worker because none of it
  # is on a call's hot path (submit, then the reply): the worker's callbacks hand these
  # messages here whole, and the table itself is VllmBridge.Worker.Calls's.
  #
  #   * **Timeouts, and callers that die.** A caller that gives up settles its call through
  #     the worker (`VllmBridge.Call.Request.give_up/2`: `:cancelled` comes back after any
  #     reply already passed on), and the calls of a caller that dies (a caller with calls
  #     in flight is monitored, once: VllmBridge.Worker.Calls) are cancelled the same way,
  #     as are calls the sweep finds past their deadline (their caller forgot them):
  #     Python drops a queued call and interrupts a running one where it is
  #     (docs/PROTOCOL.md, "Cancel"), so its slot comes back and the worker, its
  #     sessions and their state stay. A reply that still comes is dropped by the
  #     worker, and the references in it (seen by nobody) are released in their sessions.
  #   * **`cancel_grace`.** A cancelled call still running `cancel_grace` ms later did not
  #     stop when interrupted: it is stuck in C code (interrupted only once it returns to
  #     Python), in an `__enter__` (never interrupted), or it caught the interruption. The
  #     Python process is then killed and the worker restarts; every call in flight on it,
  #     and every session lost with it, says why (which request, and `cancel_grace`). As
  #     with Ctrl-C, an interruption that lands in the interrupted code's own cleanup can
  #     leave that code's state half-reset; the worker's own state is never interrupted.

  require Logger
  require VllmBridge.Worker.Messages

  alias VllmBridge.Call.Wire
  alias VllmBridge.Worker
  alias VllmBridge.Worker.{Calls, Intake, Messages, OsProcess}

  @sweep_every 1_000

  @doc false
  # How often the table of calls in flight is swept (ms; VllmBridge.Worker.Calls.sweep/3).
  @spec sweep_every() :: pos_integer()
  def sweep_every, do: @sweep_every

  @doc false
  # A caller gives up (VllmBridge.Call.Request.give_up/2, or a stream that stops): cancel
  # as below, then answer, always. A reply already passed on reaches the caller first.
  @spec settle(map(), non_neg_integer(), reference()) :: map()
  def settle(state, id, alias) do
    state = cancel(state, id)
    Messages.send_cancelled(alias)
    state
  end

  @doc false
  # A caller died: cancel its live calls as if they had timed out.
  @spec abandoned(map(), reference(), pid()) :: map()
  def abandoned(state, mon, caller) do
    {ids, calls} = Calls.abandoned(state.calls, mon, caller)
    Enum.reduce(ids, %{state | calls: calls}, &cancel(&2, &1))
  end

  @doc false
  # The periodic sweep (every `sweep_every/0` ms once ready): the calls overdue are
  # cancelled.
  @spec sweep(map()) :: map()
  def sweep(state) do
    Process.send_after(self(), :sweep, @sweep_every)
    now = System.monotonic_time(:millisecond)
    {overdue, calls} = Calls.sweep(state.calls, now, @sweep_every)
    Enum.reduce(overdue, %{state | calls: calls}, &cancel(&2, &1))
  end

  @doc false
  # `cancel_grace` ms after call `id` was cancelled: if it still runs, the Python process
  # is killed (its exit status then ends the worker, VllmBridge.Worker.Down) and the
  # reason kept for every call and session that loses it.
  @spec grace(map(), non_neg_integer()) :: map()
  def grace(state, id) do
    case Calls.overstayed(state.calls, id, state.cancel_grace) do
      nil ->
        state

      overstayed ->
        why = "the Python process (os pid #{state.os_pid}) was killed because #{overstayed}"

        Logger.warning(
          "vllm_bridge worker #{Worker.label(state)}: #{why}; the worker restarts",
          VllmBridge.Worker.LogMeta.of(state)
        )

        OsProcess.kill_worker(state.procs)
        # Every call that loses its worker, and every session lost with it, says why.
        %{state | killed: why}
    end
  end

  # The caller gave up, died, or its call is overdue: cancel it (Python drops it if
  # queued, interrupts it if running), and restart the Python process if the call still
  # runs `cancel_grace` ms from now.
  defp cancel(state, id) do
    case Calls.cancel(state.calls, id, System.monotonic_time(:millisecond)) do
      {:cancelled, calls} ->
        Intake.write(state, Wire.request("cancel", id, []))
        Process.send_after(self(), Messages.grace(id), state.cancel_grace)
        %{state | calls: calls}

      :not_live ->
        state
    end
  end
end
