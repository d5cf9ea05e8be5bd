defmodule VllmBridge.Pool.Checkout do
  @moduledoc false
  # How a caller gets room on a worker, in its own process: reserve a slot with atomics
  # (`VllmBridge.Pool.Slots`) when one is free and nobody waits; otherwise wait in the
  # pool's queue (`VllmBridge.Pool.Queue`) until it hands over a slot, the deadline passes
  # (`:timeout`) or the queue is full (`:queue_full`).
  #
  # Constraints:
  #
  #   * `:any` - any worker, the least loaded with room;
  #   * `{:prefer, i}` (affinity `:hint`) - worker `i` when it is idle (nothing in flight),
  #     else the least loaded worker with room, `i` winning ties: a call that may move does
  #     not wait behind a running call while another worker could run it now;
  #   * `{:only, i}` - wait for room on worker `i`;
  #   * `{:fail_fast, i}` - worker `i` only if it is idle (nothing running and nothing
  #     queued on it, whatever `max_in_flight` allows), else `:pool_busy` at once, saying
  #     how many calls it has or that it is restarting. Never queued.

  alias VllmBridge.Error
  alias VllmBridge.Call.Runtime
  alias VllmBridge.Pool.{Meta, Slots}
  alias VllmBridge.Telemetry

  @typedoc "Which workers a call may take."
  @type constraint ::
          :any
          | {:prefer, non_neg_integer()}
          | {:only, non_neg_integer()}
          | {:fail_fast, non_neg_integer()}

  @doc "Reserves a slot under `constraint` before `deadline`; the worker's index."
  @spec checkout(Meta.t(), constraint(), integer() | :infinity) ::
          {:ok, non_neg_integer()} | {:error, Error.t()}
  def checkout(meta, {:fail_fast, i}, _deadline) do
    case Slots.reserve_idle(meta, i) do
      :ok -> {:ok, i}
      {:busy, count} -> {:error, busy(meta, i, count)}
    end
  end

  def checkout(meta, constraint, deadline) do
    case Slots.waiting(meta) == 0 && fast(meta, constraint) do
      i when is_integer(i) -> {:ok, i}
      _ -> wait(meta, constraint, deadline)
    end
  end

  defp fast(meta, :any), do: Slots.reserve_any(meta)
  defp fast(meta, {:only, i}), do: if(Slots.reserve(meta, i), do: i)

  defp fast(meta, {:prefer, i}), do: Slots.reserve_prefer(meta, i)

  defp wait(%Meta{queue: queue} = meta, constraint, deadline) do
    alias = :erlang.alias()
    mon = Process.monitor(queue)

    wait = %VllmBridge.Pool.Queue.Wait{
      alias: alias,
      caller: self(),
      constraint: constraint,
      deadline: deadline
    }

    send(queue, {:wait, wait})

    result =
      receive do
        {^alias, :granted, i} ->
          {:ok, i}

        {^alias, :full} ->
          queue_full(meta, constraint)

          {:error,
           Error.new(
             :queue_full,
             "pool #{inspect(meta.name)}: every worker is busy and #{meta.queue_size} " <>
               "caller(s) already wait (queue_size)"
           )}

        {:DOWN, ^mon, :process, _, _} ->
          stopped(meta)
      after
        Runtime.remaining(deadline) ->
          send(queue, {:withdraw, alias})
          withdraw(meta, alias, mon)
          {:error, Error.new(:timeout, "the deadline passed while queued for a worker")}
      end

    :erlang.unalias(alias)
    Process.demonitor(mon, [:flush])
    result
  end

  # Told in the refused caller's process, as its call's own span is (VllmBridge.Telemetry).
  defp queue_full(meta, constraint) do
    if Telemetry.enabled?() do
      Telemetry.execute(
        [:vllm_bridge, :pool, :queue_full],
        %{system_time: System.system_time(), queue_size: meta.queue_size},
        %{pool: meta.name, worker: worker(constraint)}
      )
    end
  end

  defp worker({_how, i}), do: i
  defp worker(:any), do: nil

  # A slot granted just before the queue saw the withdrawal is given back.
  defp withdraw(meta, alias, mon) do
    receive do
      {^alias, :granted, i} ->
        Slots.release(meta, i)
        withdraw(meta, alias, mon)

      {^alias, :withdrawn} ->
        :ok

      {:DOWN, ^mon, :process, _, _} ->
        :ok
    end
  end

  # A count of half of Slots.down/0 or more is a worker that is not serving (a reservation
  # undone or a slot given back can leave it a little off down/0 itself).
  defp busy(meta, i, count) do
    why =
      if count >= div(Slots.down(), 2),
        do: "is restarting (not serving yet)",
        else: "is busy with #{count} call(s) running or queued"

    Error.new(
      :pool_busy,
      "worker #{i} of pool #{inspect(meta.name)} #{why}, and affinity :strict_fail_fast " <>
        "takes a worker only when it is idle"
    )
  end

  defp stopped(meta),
    do: {:error, Error.new(:worker_exit, "pool #{inspect(meta.name)} stopped while queued")}
end
