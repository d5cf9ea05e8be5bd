defmodule VllmBridge.Session.Manager do
  @moduledoc false
  # Keeps the table of open sessions (rows of `VllmBridge.Pool.Directory`) and watches
  # their owners: when an owner process dies, each of its sessions is forgotten and a
  # `close` is sent to every worker the session ran on, so its state there is released.
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
  def init(nil), do: {:ok, %{by_ref: %{}, by_id: %{}}}

  @impl true
  def handle_call({:register, %Session{id: id} = s}, _from, state) do
    if Map.has_key?(state.by_id, id) do
      {:reply, {:error, Error.new(:bad_argument, "session id #{inspect(id)} is already open")},
       state}
    else
      mref = Process.monitor(s.owner)
      :ets.insert(Directory.table(), {{:session, id}, s})

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
        targets = drop(id)
        {:reply, {:ok, targets}, %{state | by_id: by_id, by_ref: Map.delete(state.by_ref, mref)}}
    end
  end

  @impl true
  def handle_info({:DOWN, mref, :process, _pid, _reason}, state) do
    case Map.pop(state.by_ref, mref) do
      {nil, _} ->
        {:noreply, state}

      {id, by_ref} ->
        for {pid, _index} <- drop(id), do: Request.cast(pid, Session.close_request(id), :infinity)
        {:noreply, %{state | by_ref: by_ref, by_id: Map.delete(state.by_id, id)}}
    end
  end

  def handle_info(_other, state), do: {:noreply, state}

  # Removes the session's rows; returns the workers (still the same processes) it ran on.
  defp drop(id) do
    table = Directory.table()

    session =
      case :ets.take(table, {:session, id}) do
        [{_, s}] -> s
        [] -> nil
      end

    touched = :ets.match_object(table, {{:touch, id, :_}, :_})
    :ets.match_delete(table, {{:touch, id, :_}, :_})

    homes = if session, do: [{session.worker, session.instance}], else: []

    for {index, instance} <- homes ++ for({{:touch, _, i}, inst} <- touched, do: {i, inst}),
        pool = session && session.pool,
        {pid, ^instance} <- [Directory.worker(pool, index)],
        uniq: true,
        do: {pid, index}
  end
end
