defmodule VllmBridge.Session.LooseRefs do
  @moduledoc false
  # Owners of the references that calls made outside any session bring back.
  #
  # Such a reference lives in its worker's default session, which no process owns, so
  # nothing would ever release it. Instead it belongs to the process that made the call,
  # as a session belongs to its owner: when that process exits, its loose references are
  # released (in a task of their own, so a busy worker never holds this process up);
  # `VllmBridge.release/2` releases them earlier and forgets them here, and so does
  # `VllmBridge.exit/3` for the handle of a context entered outside any session. A
  # process that hands such a reference to a longer-lived one (a `Task` returning one to
  # its caller, say) should make the call in a session the longer-lived process owns
  # instead: the reference goes when the task ends.
  #
  # A limit: a process that dies with chunks of a stream (or a reply) still unread in its
  # mailbox takes their references with it, unreleased until the worker restarts (at most
  # a stream's window of chunks, `VllmBridge.Stream.window/0`); so does a stream halted by
  # a process other than the one that enumerates it. Within a session, closing the session
  # frees them.
  use GenServer

  @spec child_spec(term()) :: Supervisor.child_spec()

  require Logger

  alias VllmBridge.Ref

  @doc false
  @spec start_link(keyword()) :: GenServer.on_start()
  def start_link(_opts), do: GenServer.start_link(__MODULE__, nil, name: __MODULE__)

  @doc """
  Records `refs` (references of the default session) as owned by `owner`; they are
  released when `owner` exits. A no-op for an empty list.
  """
  @spec track(pid(), [Ref.t()]) :: :ok
  def track(_owner, []), do: :ok

  def track(owner, refs) when is_pid(owner),
    do: GenServer.cast(__MODULE__, {:track, acting_for(owner), refs})

  # The process a proxy's runner makes requests for (VllmBridge.Remote.Proxy): what it
  # would own belongs to that process, on its node.
  @acting_for {__MODULE__, :acting_for}

  @doc """
  From now on the references this process would own belong to `owner` (a process of
  another node, for which it runs requests): released when `owner` exits or its node
  goes.
  """
  @spec act_for(pid()) :: :ok
  def act_for(owner) when is_pid(owner) do
    Process.put(@acting_for, owner)
    :ok
  end

  defp acting_for(owner) when owner == self(), do: Process.get(@acting_for, owner)
  defp acting_for(owner), do: owner

  @doc """
  Forgets `refs` (they were released); references not tracked are ignored. Those of
  another node (`node` set) are forgotten there, where they are tracked.
  """
  @spec forget([Ref.t()]) :: :ok
  def forget([]), do: :ok

  def forget([first | _] = refs) do
    node = Ref.node_of(first)

    # Grouped by node only when they are of several (release/2 gives one group).
    if Enum.all?(refs, &(Ref.node_of(&1) == node)) do
      GenServer.cast({__MODULE__, node}, {:forget, refs})
    else
      for {node, refs} <- Enum.group_by(refs, &Ref.node_of/1),
          do: GenServer.cast({__MODULE__, node}, {:forget, refs})
    end

    :ok
  end

  @doc "How many references `owner` holds here (for tests and diagnostics)."
  @spec count(pid()) :: non_neg_integer()
  def count(owner), do: GenServer.call(__MODULE__, {:count, owner})

  # References released because the connection to their owner's node dropped (that
  # node may come back, and its process use them): {key, owner's node}, so that a
  # request on one answers :session_lost naming the nodes rather than the worker's
  # "released or never existed". At most @lost_cap are remembered (a few MB); past
  # that, such a request gets the worker's answer.
  @lost __MODULE__.Lost
  @lost_cap 100_000

  # State: owners %{pid => {monitor, %{key => ref}}}, where %{key => pid} points back;
  # a key is {instance, id}.
  @impl true
  def init(nil) do
    :ets.new(@lost, [:named_table, :set, :protected, read_concurrency: true])
    {:ok, %{owners: %{}, where: %{}}}
  end

  @doc """
  The node of the owner whose connection dropped, for a reference released then
  (see above); nil for any other.
  """
  @spec lost_with(Ref.t()) :: node() | nil
  def lost_with(%Ref{} = ref) do
    case :ets.lookup(@lost, key(ref)) do
      [{_, node}] -> node
      [] -> nil
    end
  rescue
    ArgumentError -> nil
  end

  @impl true
  def handle_cast({:track, owner, refs}, state) do
    {mon, held} =
      case state.owners do
        %{^owner => entry} -> entry
        _ -> {Process.monitor(owner), %{}}
      end

    held = Enum.reduce(refs, held, &Map.put(&2, key(&1), &1))
    where = Enum.reduce(refs, state.where, &Map.put(&2, key(&1), owner))
    {:noreply, %{state | owners: Map.put(state.owners, owner, {mon, held}), where: where}}
  end

  def handle_cast({:forget, refs}, state) do
    {:noreply, Enum.reduce(refs, state, &drop/2)}
  end

  @impl true
  def handle_call({:count, owner}, _from, state) do
    n =
      case state.owners do
        %{^owner => {_, held}} -> map_size(held)
        _ -> 0
      end

    {:reply, n, state}
  end

  @impl true
  def handle_info({:DOWN, _mon, :process, owner, reason}, state) do
    case Map.pop(state.owners, owner) do
      {{_mon, held}, owners} ->
        refs = Map.values(held)

        if reason == :noconnection and :ets.info(@lost, :size) < @lost_cap,
          do: :ets.insert(@lost, for(k <- Map.keys(held), do: {k, node(owner)}))

        Task.start(fn -> release(refs) end)
        {:noreply, %{state | owners: owners, where: Map.drop(state.where, Map.keys(held))}}

      {nil, _} ->
        {:noreply, state}
    end
  end

  def handle_info(_other, state), do: {:noreply, state}

  defp drop(ref, state) do
    k = key(ref)

    case Map.pop(state.where, k) do
      {nil, _} ->
        state

      {owner, where} ->
        {mon, held} = Map.fetch!(state.owners, owner)
        held = Map.delete(held, k)

        owners =
          if held == %{} do
            Process.demonitor(mon, [:flush])
            Map.delete(state.owners, owner)
          else
            Map.put(state.owners, owner, {mon, held})
          end

        %{state | owners: owners, where: where}
    end
  end

  # Worker by worker, so that one gone or going (its references go with it) does not keep the
  # others'; waiting for a busy worker rather than failing fast, whatever the configured
  # affinity. Anything else that fails is worth a line.
  defp release(refs) do
    for {_instance, group} <- Enum.group_by(refs, & &1.instance) do
      case VllmBridge.release(group, timeout: 60_000, affinity: :strict_queue) do
        {:ok, _n} ->
          :ok

        {:error, %VllmBridge.Error{type: type}} when type in [:session_lost, :worker_exit] ->
          :ok

        {:error, e} ->
          Logger.warning(
            "vllm_bridge: releasing #{length(group)} reference(s) of a process that " <>
              "exited failed: #{Exception.message(e)}"
          )
      end
    end
  end

  defp key(%Ref{instance: instance, id: id}), do: {instance, id}
end
