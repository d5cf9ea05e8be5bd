defmodule VllmBridge.Pool.Directory do
  @moduledoc false
  # Where callers look things up without sending a message: one public ETS table (owned by
  # this process, started by the application) holding
  #
  #   * `{{:pool, name}, %VllmBridge.Pool.Meta{}}` - each started pool (for `pools/0`; a
  #     caller reads the same meta from `:persistent_term`, below);
  #   * `{{:worker, name, index}, pid, instance}` - each worker that finished its handshake
  #     (removed when it goes down);
  #   * `{{:instance, instance}, name, index, pid}` - the same, by handshake instance (how a
  #     `%VllmBridge.Ref{}` finds its worker);
  #   * `{{:session, id}, %VllmBridge.Session{}}` and `{{:touch, id, index, session},
  #     instance}` - open sessions and the other workers a session's `:hint` calls ran on;
  #   * `{{:down, name, index}, instance, why}` - why the last process at that index went
  #     down (one row per index, overwritten), so that a session lost with it can say why.
  #
  # (A worker's restart count is not here: it is the pool meta's `starts` atomics.)
  #
  # Reads are concurrent; each writer owns its rows (a pool's queue its `:pool` row, a
  # worker its `:worker`/`:instance` rows, the session manager the session rows).
  #
  # What every call reads is also kept in `:persistent_term`, written and erased with its
  # row by the row's writer: a pool's meta under `{VllmBridge.Pool.Directory, {:pool,
  # name}}`, and the pid of each worker that is up under `{VllmBridge.Pool.Directory,
  # {:worker, name, index}}` (`worker_pid/2`). A read there takes 30-40 ns and copies
  # nothing, against 150-230 ns for the table's (its read lock, the key's hash, a copy of
  # the row), and more when the caches are cold, as they are between two calls
  # (bench/results/caller-path.md). A write or erase of a compound term (a meta) makes
  # every process look for the old value once: a meta is written when its pool's queue
  # starts and erased when it stops, never per call; a pid is a term of one word, whose
  # writes and erases cost no such pass (a worker's restart). When this process starts
  # (after a crash, its table gone with every row) and when it stops (the application
  # stopping), it erases every such term, so that both places forget the same pools.
  use GenServer

  @spec child_spec(term()) :: Supervisor.child_spec()

  alias VllmBridge.Pool.Meta

  @table __MODULE__

  @doc false
  @spec start_link(keyword()) :: GenServer.on_start()
  def start_link(_opts), do: GenServer.start_link(__MODULE__, nil, name: __MODULE__)

  @impl true
  def init(nil) do
    # (Trapped so that terminate/2 runs when the application stops.)
    Process.flag(:trap_exit, true)
    :ets.new(@table, [:set, :public, :named_table, read_concurrency: true])
    forget_all()
    {:ok, nil}
  end

  @impl true
  def terminate(_reason, _state), do: forget_all()

  # Every meta and pid kept in :persistent_term (see the comment at the top).
  defp forget_all do
    for {{__MODULE__, _} = key, _value} <- :persistent_term.get(),
        do: :persistent_term.erase(key)

    :ok
  end

  @doc "The table's name."
  @spec table() :: atom()
  def table, do: @table

  @doc "A started pool's meta data."
  @spec pool(term()) :: {:ok, Meta.t()} | :error
  def pool(name) do
    case :persistent_term.get({__MODULE__, {:pool, name}}, nil) do
      %Meta{} = meta -> {:ok, meta}
      nil -> :error
    end
  end

  @doc "Every started pool's name ([] while the application is not started)."
  @spec pools() :: [term()]
  def pools do
    :ets.select(@table, [{{{:pool, :"$1"}, :_}, [], [:"$1"]}])
  rescue
    ArgumentError -> []
  end

  @doc """
  Whether the application runs (its table exists). Asked only on the way to an error:
  the readers below answer "not found" while it is not started, and the caller's error
  then says which of the two it is (`not_started/1`).
  """
  @spec started?() :: boolean()
  def started?, do: :ets.whereis(@table) != :undefined

  @doc """
  The error of a request that finds nothing here: the application is not started, or
  else `otherwise` (a function that builds the error of a missing pool, session, ...).
  """
  @spec not_started((() -> VllmBridge.Error.t())) :: VllmBridge.Error.t()
  def not_started(otherwise), do: if(started?(), do: otherwise.(), else: app_error())

  @doc "`:ok` while the application runs, else its not-started error."
  @spec app_started() :: :ok | {:error, VllmBridge.Error.t()}
  def app_started, do: if(started?(), do: :ok, else: {:error, app_error()})

  defp app_error do
    VllmBridge.Error.new(
      :bad_argument,
      "the :vllm_bridge application is not started (it starts with an app that depends " <>
        "on it; in a script or iex, Application.ensure_all_started(:vllm_bridge))"
    )
  end

  @doc false
  @spec put_pool(Meta.t()) :: true
  def put_pool(%Meta{name: name} = meta) do
    :ets.insert(@table, {{:pool, name}, meta})
    :persistent_term.put({__MODULE__, {:pool, name}}, meta)
    true
  end

  @doc false
  @spec delete_pool(term()) :: true
  def delete_pool(name) do
    # (Erased first: a caller that still finds the meta finds its rows too, or none.)
    case pool(name) do
      {:ok, %Meta{size: size}} ->
        :persistent_term.erase({__MODULE__, {:pool, name}})

        # The pid of a worker killed without its terminate/2 (the others erased theirs).
        # Only a dead one: a queue that crashed (and ran this) leaves its workers up, and
        # they serve on once its successor republishes the meta.
        for i <- 0..(size - 1),
            pid = worker_pid(name, i),
            pid != nil and not Process.alive?(pid),
            do: :persistent_term.erase({__MODULE__, {:worker, name, i}})

      :error ->
        :ok
    end

    :ets.match_delete(@table, {{:down, name, :_}, :_, :_})
    :ets.delete(@table, {:pool, name})
  end

  @doc """
  The pid of the live worker at `index` of pool `name`, or nil: `worker/2` without the
  instance, for a call's path (read from `:persistent_term`: see the comment at the top
  of this module).
  """
  @spec worker_pid(term(), non_neg_integer()) :: pid() | nil
  def worker_pid(name, index), do: :persistent_term.get({__MODULE__, {:worker, name, index}}, nil)

  @doc "The live worker at `index` of pool `name`: `{pid, instance}`."
  @spec worker(term(), non_neg_integer()) :: {pid(), String.t()} | nil
  def worker(name, index) do
    case :ets.lookup(@table, {:worker, name, index}) do
      [{_, pid, instance}] -> {pid, instance}
      [] -> nil
    end
  rescue
    ArgumentError -> nil
  end

  @doc "The live worker whose handshake instance is `instance`: `{pool, index, pid}`."
  @spec instance(String.t()) :: {term(), non_neg_integer(), pid()} | nil
  def instance(instance) do
    case :ets.lookup(@table, {:instance, instance}) do
      [{_, name, index, pid}] -> {name, index, pid}
      [] -> nil
    end
  rescue
    ArgumentError -> nil
  end

  @doc false
  @spec worker_up(term(), non_neg_integer(), pid(), String.t()) :: true
  def worker_up(name, index, pid, instance) do
    # (The pid first, erased first too: whoever finds the row finds the pid.)
    :persistent_term.put({__MODULE__, {:worker, name, index}}, pid)

    :ets.insert(@table, [
      {{:worker, name, index}, pid, instance},
      {{:instance, instance}, name, index, pid}
    ])
  end

  @doc false
  # A worker starting over: drop whatever rows a predecessor killed without its
  # `terminate/2` left behind.
  @spec clear_worker(term(), non_neg_integer()) :: :ok
  def clear_worker(name, index) do
    :persistent_term.erase({__MODULE__, {:worker, name, index}})

    case :ets.take(@table, {:worker, name, index}) do
      [{_, _pid, instance}] -> :ets.delete(@table, {:instance, instance})
      [] -> :ok
    end

    :ok
  end

  @doc false
  @spec worker_down(term(), non_neg_integer(), String.t() | nil, String.t()) :: :ok
  def worker_down(name, index, instance, why) do
    # The reason first: a reader that no longer finds the worker finds why it went.
    if instance, do: :ets.insert(@table, {{:down, name, index}, instance, why})
    # Only the rows of this very process: a successor may already be up. (Its pid only,
    # likewise; a successor's is written by the successor itself.)
    if worker_pid(name, index) == self(),
      do: :persistent_term.erase({__MODULE__, {:worker, name, index}})

    :ets.match_delete(@table, {{:worker, name, index}, :_, instance})
    if instance, do: :ets.delete(@table, {:instance, instance})
    :ok
  end

  @doc "Why the process `instance` at `index` of pool `name` went down, if it is the last that did."
  @spec down_reason(term(), non_neg_integer(), String.t()) :: String.t() | nil
  def down_reason(name, index, instance) do
    case :ets.lookup(@table, {:down, name, index}) do
      [{_, ^instance, why}] -> why
      _ -> nil
    end
  rescue
    ArgumentError -> nil
  end
end
