defmodule VllmBridge.Session.Manager do
  @moduledoc false
  # Keeps the table of open sessions (rows of `VllmBridge.Pool.Directory`) and watches
  # their owners: when an owner process dies, each of its sessions is forgotten and a
  # `close` is sent to every worker the session ran on, so its state there is released.
  #
  # It also watches the nodes of the sessions of other nodes known here: when the
  # connection to one drops, that node's manager sees their owners (processes of this
  # node) go and closes them there, even if the connection comes back. So they are
  # marked lost here (a row `{{:lost, id}, node}`): their requests answer :session_lost
  # naming the node (VllmBridge.Call.Route), and closing them only forgets them.
  use GenServer

  @spec child_spec(term()) :: Supervisor.child_spec()

  alias VllmBridge.{Error, Session}
  alias VllmBridge.Call.Request
  alias VllmBridge.Pool.Directory

  @doc false
  @spec start_link(keyword()) :: GenServer.on_start()
  def start_link(_opts), do: GenServer.start_link(__MODULE__, nil, name: __MODULE__)

  @doc false
  @spec register(Session.t()) :: {:ok, Session.t()} | {:error, Error.t()}
  def register(%Session{} = s), do: GenServer.call(__MODULE__, {:register, s})

  @doc false
  # Forgets a session; the live workers to send `close` to, as `[{pid, index}]`.
  @spec forget(String.t()) :: {:ok, [{pid(), non_neg_integer()}]} | :error
  def forget(id), do: GenServer.call(__MODULE__, {:forget, id})

  @impl true
  def init(nil), do: {:ok, %{by_ref: %{}, by_id: %{}, nodes: %{}}}

  @doc false
  # The node a session of another node lived on, once the connection to it dropped.
  @spec lost_on(String.t()) :: node() | nil
  def lost_on(id) do
    case :ets.lookup(Directory.table(), {:lost, id}) do
      [{_, node}] -> node
      [] -> nil
    end
  end

  @impl true
  def handle_call({:register, %Session{id: id} = s}, _from, state) do
    if Map.has_key?(state.by_id, id) do
      {:reply, {:error, Error.new(:bad_argument, "session id #{inspect(id)} is already open")},
       state}
    else
      mref = Process.monitor(s.owner)
      :ets.insert(Directory.table(), {{:session, id}, s})
      state = watch_node(state, s)

      {:reply, {:ok, s},
       %{state | by_ref: Map.put(state.by_ref, mref, id), by_id: Map.put(state.by_id, id, mref)}}
    end
  end

  def handle_call({:forget, id}, _from, state) do
    case Map.pop(state.by_id, id) do
      {nil, _} ->
        {:reply, :error, state}

      {mref, by_id} ->
        Process.demonitor(mref, [:flush])
        {session, targets} = drop(id)
        state = unwatch_node(state, session)
        {:reply, {:ok, targets}, %{state | by_id: by_id, by_ref: Map.delete(state.by_ref, mref)}}
    end
  end

  @impl true
  def handle_info({:DOWN, mref, :process, _pid, _reason}, state) do
    case Map.pop(state.by_ref, mref) do
      {nil, _} ->
        {:noreply, state}

      {id, by_ref} ->
        {session, targets} = drop(id)
        for {pid, _index} <- targets, do: Request.cast(pid, Session.close_request(id), :infinity)
        state = unwatch_node(state, session)
        {:noreply, %{state | by_ref: by_ref, by_id: Map.delete(state.by_id, id)}}
    end
  end

  # Every session of that node is lost (one message per monitor: the later ones find
  # none left).
  def handle_info({:nodedown, node}, state) do
    {ids, nodes} = Map.pop(state.nodes, node, MapSet.new())
    for id <- ids, do: :ets.insert(Directory.table(), {{:lost, id}, node})
    {:noreply, %{state | nodes: nodes}}
  end

  def handle_info(_other, state), do: {:noreply, state}

  # A session of another node: that node is monitored while a session of it is known.
  defp watch_node(state, %Session{node: n, id: id}) when n != nil and n != node() do
    true = :erlang.monitor_node(n, true)
    %{state | nodes: Map.update(state.nodes, n, MapSet.new([id]), &MapSet.put(&1, id))}
  end

  defp watch_node(state, _s), do: state

  defp unwatch_node(state, %Session{node: n, id: id}) when n != nil and n != node() do
    case state.nodes do
      %{^n => ids} ->
        :erlang.monitor_node(n, false)
        ids = MapSet.delete(ids, id)

        nodes =
          if MapSet.size(ids) == 0,
            do: Map.delete(state.nodes, n),
            else: Map.put(state.nodes, n, ids)

        %{state | nodes: nodes}

      _ ->
        state
    end
  end

  defp unwatch_node(state, _s), do: state

  # Removes the session's rows; returns it (nil if its row was gone) and the workers
  # (still the same processes) it ran on.
  defp drop(id) do
    table = Directory.table()
    :ets.delete(table, {:lost, id})

    session =
      case :ets.take(table, {:session, id}) do
        [{_, s}] -> s
        [] -> nil
      end

    # (Every session's of the id: this manager registers none while it drops one.)
    touched = :ets.match_object(table, {{:touch, id, :_, :_}, :_})
    :ets.match_delete(table, {{:touch, id, :_, :_}, :_})

    homes = if session, do: [{session.worker, session.instance}], else: []

    targets =
      for {index, instance} <- homes ++ for({{:touch, _, i, _}, inst} <- touched, do: {i, inst}),
          pool = session && session.pool,
          {pid, ^instance} <- [Directory.worker(pool, index)],
          uniq: true,
          do: {pid, index}

    {session, targets}
  end
end
