defmodule VllmBridge.Pool.Slots do
  @moduledoc false
  # Capacity of a pool's workers, kept in one `:atomics` array so that a caller can pick a
  # worker and reserve room on it without sending a message.
  #
  # Element `i + 1` counts the calls in flight on worker `i` (reserved by a caller, released
  # by the worker when the reply is in); element `size + 1` is how many callers wait in the
  # pool's queue (published by `VllmBridge.Pool.Queue`). A worker that is not serving (still
  # starting, or gone) holds a count of `down/0`, so no reservation on it succeeds; it
  # resets its count to 0 once its handshake is done.
  #
  # A reservation is `add_get`; one that overshoots `max_in_flight` is undone at once. A
  # reservation that needs the worker idle (`reserve_idle/2`, for `:strict_fail_fast` and
  # the first choice of `:hint`) is a `compare_exchange` from the count found to one more,
  # and only from a count of 0 or below. When callers are waiting, a new caller does not
  # take a freed slot ahead of them: it queues too (`waiting/1`), so the queue is served in
  # order.
  #
  # A count can be left wrong: a caller that dies between reserving and sending leaves one
  # reservation nobody gives back, and the worker's sweep that sets that right can take back
  # a reservation whose request was merely slow to arrive, which then leaves the count below
  # zero once it is answered. The worker's sweep (`VllmBridge.Worker.Calls`) sets a count
  # below what it holds right at once, and a count above it only when it has seen it
  # unchanged over a whole sweep with nothing in flight and nothing arriving; until then, a
  # count below zero means idle.

  import Bitwise, only: [<<<: 2]

  alias VllmBridge.Pool.{Directory, Meta}

  @down 1 <<< 40

  @doc "The count a worker that is not serving holds."
  @spec down() :: pos_integer()
  def down, do: @down

  @doc "New counters for `size` workers, all down."
  @spec new(pos_integer()) :: :atomics.atomics_ref()
  def new(size) do
    ref = :atomics.new(size + 1, signed: true)
    for i <- 1..size, do: :atomics.put(ref, i, @down)
    ref
  end

  @doc "Tries to reserve room on worker `index`."
  @spec reserve(Meta.t(), non_neg_integer()) :: boolean()
  def reserve(%Meta{slots: slots, max_in_flight: max}, index) do
    if :atomics.add_get(slots, index + 1, 1) <= max do
      true
    else
      :atomics.sub(slots, index + 1, 1)
      false
    end
  end

  @doc """
  Reserves room on worker `index` only when it has nothing in flight (its count is 0, or
  below after a correction, see the moduledoc): `:ok`, or `{:busy, count}` with the count
  found (`down/0` or more while it is not serving). A `compare_exchange` from the count
  found to one more, retried when another caller changed it first, so two callers never
  both find it idle.
  """
  @spec reserve_idle(Meta.t(), non_neg_integer()) :: :ok | {:busy, integer()}
  def reserve_idle(%Meta{slots: slots}, index), do: reserve_idle(slots, index + 1, 0)

  defp reserve_idle(slots, i, count) when count <= 0 do
    case :atomics.compare_exchange(slots, i, count, count + 1) do
      :ok -> :ok
      found -> reserve_idle(slots, i, found)
    end
  end

  defp reserve_idle(_slots, _i, count), do: {:busy, count}

  @doc """
  Reserves room for a call that prefers worker `home` (affinity `:hint`): `home` when it
  is idle, else the least loaded worker with room, `home` winning ties. Its index, or nil.
  """
  @spec reserve_prefer(Meta.t(), non_neg_integer()) :: non_neg_integer() | nil
  def reserve_prefer(meta, home) do
    case reserve_idle(meta, home) do
      :ok -> home
      {:busy, _} -> reserve_least(meta, home)
    end
  end

  @doc "Reserves room on the least loaded worker with room; its index, or nil."
  @spec reserve_any(Meta.t()) :: non_neg_integer() | nil
  def reserve_any(%Meta{size: 1} = meta), do: if(reserve(meta, 0), do: 0)
  def reserve_any(meta), do: reserve_least(meta, nil)

  # The least loaded worker with room, `home` first among equals; the others in an order
  # that starts at a random worker, so that ties spread over the pool.
  #
  # One pass finds the first of that order (what a sort would put first) and reserves it;
  # only when another caller took its room meanwhile are the loads read again and the
  # candidates tried in order (`reserve_sorted/4`).
  defp reserve_least(%Meta{size: size, slots: slots, max_in_flight: max} = meta, home) do
    start = :erlang.unique_integer([:positive]) |> rem(size)

    case least(slots, size, max, home, start, 0, nil, nil) do
      nil -> nil
      i -> if reserve(meta, i), do: i, else: reserve_sorted(meta, home, start)
    end
  end

  # The first worker, from `start` round the pool, with the smallest {load, not home}
  # among those with room: `k` workers looked at so far, `best` its key, `best_i` it.
  defp least(_slots, size, _max, _home, _start, size, _best, best_i), do: best_i

  defp least(slots, size, max, home, start, k, best, best_i) do
    i = rem(start + k, size)
    load = :atomics.get(slots, i + 1)
    key = {load, i != home}

    if load < max and (best == nil or key < best),
      do: least(slots, size, max, home, start, k + 1, key, i),
      else: least(slots, size, max, home, start, k + 1, best, best_i)
  end

  defp reserve_sorted(%Meta{size: size, slots: slots, max_in_flight: max} = meta, home, start) do
    candidates =
      for k <- 0..(size - 1),
          i = rem(start + k, size),
          load = :atomics.get(slots, i + 1),
          load < max,
          do: {{load, i != home}, i}

    candidates
    |> Enum.sort_by(&elem(&1, 0))
    |> Enum.find_value(fn {_key, i} -> if reserve(meta, i), do: i end)
  end

  @doc "Whether worker `index` has room now (no reservation made)."
  @spec room?(Meta.t(), non_neg_integer()) :: boolean()
  def room?(%Meta{slots: slots, max_in_flight: max}, index),
    do: :atomics.get(slots, index + 1) < max

  @doc "Whether any worker has room now (no reservation made)."
  @spec any_room?(Meta.t()) :: boolean()
  def any_room?(%Meta{size: size} = meta),
    do: Enum.any?(0..(size - 1), &room?(meta, &1))

  @doc "Gives back a slot of worker `index`; tells the queue when callers wait."
  @spec release(Meta.t(), non_neg_integer()) :: :ok
  def release(%Meta{slots: slots, size: size} = meta, index) do
    :atomics.sub(slots, index + 1, 1)
    if :atomics.get(slots, size + 1) > 0, do: kick(meta)
    :ok
  end

  @doc "Asks the pool's queue (as the directory knows it now) to hand out free slots."
  @spec kick(Meta.t()) :: :ok
  def kick(%Meta{name: name}) do
    case Directory.pool(name) do
      {:ok, %Meta{queue: queue}} when is_pid(queue) -> send(queue, :kick)
      _ -> :ok
    end

    :ok
  end

  @doc "How many callers wait in the queue."
  @spec waiting(Meta.t()) :: non_neg_integer()
  def waiting(%Meta{slots: slots, size: size}), do: :atomics.get(slots, size + 1)

  @doc false
  @spec set_waiting(Meta.t(), non_neg_integer()) :: :ok
  def set_waiting(%Meta{slots: slots, size: size}, n), do: :atomics.put(slots, size + 1, n)

  @doc "The in-flight count of worker `index` (`down/0` or more while it is not serving)."
  @spec load(Meta.t(), non_neg_integer()) :: integer()
  def load(%Meta{slots: slots}, index), do: :atomics.get(slots, index + 1)

  @doc false
  # The worker's own view: up (count 0) or down.
  @spec put_load(Meta.t(), non_neg_integer(), integer()) :: :ok
  def put_load(%Meta{slots: slots}, index, n), do: :atomics.put(slots, index + 1, n)

  @doc false
  # The worker's correction of a wrong count: `from` becomes `to` unless a caller changed
  # it since it was read (then the next sweep looks again).
  @spec correct_load(Meta.t(), non_neg_integer(), integer(), integer()) :: boolean()
  def correct_load(%Meta{slots: slots}, index, from, to),
    do: :atomics.compare_exchange(slots, index + 1, from, to) == :ok
end
