defmodule VllmBridge.Pool.Queue do
  @moduledoc false
  # A pool's bounded queue of callers waiting for a slot; only on the path of a caller that
  # found no room (`VllmBridge.Pool.Checkout`). It also publishes the pool's
  # `VllmBridge.Pool.Meta` in the directory (and removes it when it stops).
  #
  # A waiter names what it may take: `:any` worker, `{:prefer, i}` (worker `i` when idle,
  # else the least loaded; see `VllmBridge.Pool.Checkout`) or `{:only, i}`. When a slot frees (a worker sends `:kick`), waiters are served in
  # arrival order, each on a worker it may use; a waiter that cannot be served yet keeps its
  # place and does not hold up those behind it that can. The queue reserves the slot
  # itself and tells the waiter which worker it got (`{alias, :granted, index}`); the
  # waiter then sends its request as on the fast path. A waiter whose deadline passed, that
  # withdrew, or that died is dropped. Past `queue_size` waiters, a new one is answered
  # `{alias, :full}` at once.
  use GenServer

  @spec child_spec(term()) :: Supervisor.child_spec()

  alias VllmBridge.Pool.{Directory, Meta, Slots}

  @doc false
  @spec start_link(Meta.t()) :: GenServer.on_start()
  def start_link(%Meta{} = meta), do: GenServer.start_link(__MODULE__, meta)

  defmodule Wait do
    @moduledoc false
    # A caller asks for a slot: replies go to `alias`; `caller` is monitored (its death
    # drops the wait); `constraint` says which workers may serve it; past `deadline`
    # (monotonic ms) its caller has given up by itself.
    @enforce_keys [:alias, :caller, :constraint, :deadline]
    defstruct [:alias, :caller, :constraint, :deadline]

    @type t :: %__MODULE__{
            alias: reference(),
            caller: pid(),
            constraint: VllmBridge.Pool.Checkout.constraint(),
            deadline: integer() | :infinity
          }
  end

  @impl true
  def init(meta) do
    Process.flag(:trap_exit, true)
    meta = %{meta | queue: self()}
    Directory.put_pool(meta)
    Slots.set_waiting(meta, 0)
    # Found from the other nodes by its name from now on; :pg drops the membership when
    # this process exits (the pool stops) or when this node goes (VllmBridge.Remote).
    :ok = :pg.join(VllmBridge.Remote.scope(), {:pool, meta.name}, self())
    {:ok, %{meta: meta, order: :queue.new(), entries: %{}, monitors: %{}}}
  end

  @impl true
  def handle_info({:wait, %Wait{alias: alias, caller: pid} = wait}, state) do
    if map_size(state.entries) >= state.meta.queue_size do
      send(alias, {alias, :full})
      {:noreply, state}
    else
      mref = Process.monitor(pid)
      entries = Map.put(state.entries, alias, {wait.constraint, wait.deadline, mref})
      monitors = Map.put(state.monitors, mref, alias)

      state = %{
        state
        | entries: entries,
          monitors: monitors,
          order: :queue.in(alias, state.order)
      }

      # Publish the count before looking for room: a worker that frees a slot after
      # this either sees a waiter (and kicks) or freed it before we look.
      Slots.set_waiting(state.meta, map_size(entries))
      {:noreply, serve(state)}
    end
  end

  def handle_info(:kick, state), do: {:noreply, serve(state)}

  def handle_info({:withdraw, alias}, state) do
    state = drop(state, alias)
    send(alias, {alias, :withdrawn})
    {:noreply, state}
  end

  def handle_info({:DOWN, mref, :process, _pid, _reason}, state) do
    case Map.fetch(state.monitors, mref) do
      {:ok, alias} -> {:noreply, drop(state, alias)}
      :error -> {:noreply, state}
    end
  end

  def handle_info(_other, state), do: {:noreply, state}

  @impl true
  def terminate(_reason, state) do
    # Out of the other nodes' routing before the workers go.
    :pg.leave(VllmBridge.Remote.scope(), {:pool, state.meta.name}, self())
    Directory.delete_pool(state.meta.name)
    :ok
  end

  defp drop(state, alias) do
    case Map.pop(state.entries, alias) do
      {nil, _} ->
        state

      {{_c, _d, mref}, entries} ->
        Process.demonitor(mref, [:flush])
        Slots.set_waiting(state.meta, map_size(entries))
        state = %{state | entries: entries, monitors: Map.delete(state.monitors, mref)}
        # The alias stays in `order` (`serve/1` skips it) unless such leftovers pile up.
        if :queue.len(state.order) > 2 * map_size(entries) + 16,
          do: %{state | order: :queue.filter(&Map.has_key?(entries, &1), state.order)},
          else: state
    end
  end

  # Walk the waiters in order, granting what the free slots allow.
  defp serve(%{meta: meta} = state) do
    if map_size(state.entries) > 0 and Slots.any_room?(meta) do
      now = System.monotonic_time(:millisecond)
      {kept, entries} = walk(:queue.to_list(state.order), meta, now, state.entries, [])
      Slots.set_waiting(meta, map_size(entries))
      monitors = Map.filter(state.monitors, fn {_m, alias} -> Map.has_key?(entries, alias) end)
      %{state | entries: entries, monitors: monitors, order: :queue.from_list(kept)}
    else
      state
    end
  end

  defp walk([], _meta, _now, entries, kept), do: {Enum.reverse(kept), entries}

  defp walk([alias | rest] = all, meta, now, entries, kept) do
    case Map.fetch(entries, alias) do
      :error ->
        walk(rest, meta, now, entries, kept)

      {:ok, {_c, deadline, mref}} when is_integer(deadline) and deadline <= now ->
        # Its caller times out by itself; it will not be served.
        Process.demonitor(mref, [:flush])
        walk(rest, meta, now, Map.delete(entries, alias), kept)

      {:ok, {constraint, _deadline, mref}} ->
        case grant(meta, constraint) do
          nil ->
            if Slots.any_room?(meta),
              do: walk(rest, meta, now, entries, [alias | kept]),
              else: {Enum.reverse(kept, all), entries}

          index ->
            Process.demonitor(mref, [:flush])
            send(alias, {alias, :granted, index})
            walk(rest, meta, now, Map.delete(entries, alias), kept)
        end
    end
  end

  defp grant(meta, :any), do: Slots.reserve_any(meta)

  defp grant(meta, {:prefer, i}), do: Slots.reserve_prefer(meta, i)

  defp grant(meta, {:only, i}), do: if(Slots.reserve(meta, i), do: i)
end
