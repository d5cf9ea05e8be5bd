defmodule VllmBridge.Session do
  @moduledoc """
  A session pins a caller's state (its forward context, its references, its entered
  context managers) to one worker of a pool.

      {:ok, s} = VllmBridge.Session.open(pool_name: :ranks, worker: 2)   # DP rank 2
      VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [1, 2], %{}, session_id: s.id)
      :ok = VllmBridge.Session.close(s)

  or `VllmBridge.with_session(fn s -> ... end, opts)`, which always closes.

  Opening sends nothing: it picks the worker (`worker: index`, or the least loaded) and
  remembers its handshake instance. The worker creates the session's state on first use.
  Closing sends `close` to that worker (and to any other worker a `:hint` call of the
  session ran on), which exits the session's entered contexts and drops its references.
  If the process that opened the session (its owner) dies first, the session is closed
  for it.

  **Affinity** (runtime option `affinity:`) decides what a session's call does when its
  worker is not idle. Busy means busy: a worker running one call, or holding one queued
  behind it, is busy, however many more `max_in_flight` would let it take.

    * `:strict_queue` (the default) - go to the session's worker: pipelined behind the
      calls it has while it has room (`max_in_flight`), else wait in the pool's queue;
    * `:strict_fail_fast` - run only if the session's worker is idle (nothing running,
      nothing queued on it); otherwise fail at once with
      `{:error, %Error{type: :pool_busy}}`, whose message says how many calls the worker
      has, or that it is restarting. The same holds for a request bound to a reference
      under `:strict_fail_fast`. The call never waits and never queues;
    * `:hint` - run on the session's worker when it is idle; when it is running or holds
      a call, run on the least loaded worker with room (the session's worker wins ties,
      so with every worker busy alike the call stays home). Only a call that carries no
      session state may move: a call whose target, args or kwargs hold a
      `%VllmBridge.Ref{}` (a `get` or call on a reference, `exit`, `release`), and every
      `enter`, stays on the session's worker as under `:strict_queue`. A call that
      *reads* session state without carrying any (`get_forward_context()`) cannot be told
      apart: use `:hint` only for calls you know to be state-free. A moved call still
      runs under the session's id on the other worker; whatever it leaves there is
      released when the session closes.

  **Restarts.** A session lives on one worker process. Once that process is gone (the
  worker restarted with a new instance), every call in the session gets
  `{:error, %Error{type: :session_lost}}`, whose message says why the process went down
  when this node knows (it exited with a status, or it was killed because a call did not
  stop within `cancel_grace` of its cancel); close it and open a new one. A call that
  times out does not cost the session: it is interrupted in Python and the session's
  next call runs normally (see `VllmBridge`, "Timeouts cancel in place").
  """

  alias VllmBridge.Error
  alias VllmBridge.Call.{Request, Runtime, Wire}
  alias VllmBridge.Pool.{Directory, Slots}
  alias VllmBridge.Session.{Manager, Remote}

  @enforce_keys [:id, :pool, :worker, :instance, :owner]
  defstruct [:id, :pool, :worker, :instance, :owner, node: nil, token: nil]

  @typedoc """
  `node`: the node of the session's worker (`nil` read as this node). `token`: unique to
  one `open/1`, so that a session closed and opened again under its id, even on the same
  worker by the same owner, is not equal to the one before.
  """
  @type t :: %__MODULE__{
          id: String.t(),
          pool: term(),
          worker: non_neg_integer(),
          instance: String.t(),
          owner: pid(),
          node: node() | nil,
          token: reference() | nil
        }

  @open_keys [:pool_name, :worker, :owner, :id, :node]

  # The process-dictionary key of the current session (current/0, with_current/2).
  @current {__MODULE__, :current}

  @doc """
  Opens a session. Options: `pool_name:` (default the configured runtime pool,
  `:default`), `worker:` (index of the worker, e.g. a DP rank; default the least loaded),
  `owner:` (the process whose death closes it; default the caller), `id:` (a string;
  default a fresh random one), `node:` (the node whose pool it runs on, as the runtime
  option `node:`: default this node when it has the pool, else a node that has it).

  A session on another node (its `node` field) is opened and closed there, and its
  requests run there, whatever node makes them (`VllmBridge.Runtime`, "Nodes"); its
  owner's exit, or its owner's node going, closes it there. If the session's node goes
  down, its requests answer `:session_lost` naming the node.
  """
  @spec open(keyword()) :: {:ok, t()} | {:error, Error.t()}
  def open(opts \\ []) do
    with :ok <- check_keys(opts),
         {:ok, pool} <- pool_name(opts),
         {:ok, pinned} <- node_opt(opts),
         {:local, meta} <- Remote.where(pool, pinned, opts),
         {:ok, index} <- pick(meta, Keyword.get(opts, :worker)),
         {:ok, instance} <- instance(pool, index),
         {:ok, id} <- new_id(Keyword.get(opts, :id)),
         {:ok, owner} <- owner(Keyword.get(opts, :owner, self())) do
      session = %__MODULE__{
        id: id,
        pool: pool,
        worker: index,
        instance: instance,
        owner: owner,
        node: node(),
        token: make_ref()
      }

      Manager.register(session)
    else
      # The id is chosen here, so that an open that times out can be undone there.
      {:remote, node, opts} ->
        with {:ok, id} <- new_id(Keyword.get(opts, :id)),
             do: Remote.open_on(node, Keyword.put(opts, :id, id))

      {:error, e} ->
        {:error, e}
    end
  end

  @doc "The node a session's worker is on (`nil` read as this node)."
  @spec node_of(t()) :: node()
  def node_of(%__MODULE__{node: nil}), do: node()
  def node_of(%__MODULE__{node: n}), do: n

  defp node_opt(opts) do
    case Keyword.get(opts, :node) do
      # The common case costs nothing more than before nodes existed.
      nil ->
        {:ok, nil}

      n when is_atom(n) and n not in [true, false] ->
        with {:ok, rt} <- Runtime.resolve(node: n), do: {:ok, rt.node}

      other ->
        Runtime.resolve(node: other)
    end
  end

  @doc """
  Closes a session (a struct or its id): forgets it, sends `close` to its worker (and to
  the other workers its `:hint` calls ran on) and waits up to `timeout` ms for them.

  The close is never cancelled: when a worker is busy past `timeout` (a long call ahead of
  it), the result is `{:error, %Error{type: :timeout}}` but the close still runs when the
  worker gets to it, and the session's state there is released then (likewise if the
  calling process dies while it waits). Closing a session whose worker restarted only
  forgets it. Unknown ids are `:bad_argument`.

  A request of the session that has not reached its worker when the session closes (it
  waits in the pool's queue for room on the worker, say) is not run: it answers
  `{:error, %Error{type: :bad_argument}}` saying that the session closed. Run after the
  close, it would make the session afresh on the worker, with nothing left to close it.
  The same holds when the session closes because its owner died, and for a session
  closed and opened again under the same id: a request routed for the one closed is
  refused. Requests written to the worker's port before the close run, then the close. A
  reference of a closed session is refused likewise (`:bad_argument`), also once a session
  of the same id is open again, unless that session ran on the reference's worker
  process.
  """
  @spec close(t() | String.t(), timeout()) :: :ok | {:error, Error.t()}
  def close(session, timeout \\ 5_000)
  # A session of another node that this node does not know (the struct came in a
  # message, say) is closed on its node.
  def close(%__MODULE__{id: id, node: n}, timeout)
      when n not in [nil, :nonode@nohost] and n != node() do
    case lookup(id) do
      {:ok, _} -> close(id, timeout)
      {:error, _} -> Remote.close_on(n, id, timeout)
    end
  end

  def close(%__MODULE__{id: id}, timeout), do: close(id, timeout)

  def close(id, timeout) when is_binary(id) do
    case lookup(id) do
      {:ok, %__MODULE__{node: n}} when n != nil and n != node() ->
        # Lost with its node's connection: closed there already.
        if Manager.lost_on(id), do: Remote.forget_lost(id), else: Remote.close_on(n, id, timeout)

      _ ->
        close_here(id, timeout)
    end
  end

  def close(other, _timeout),
    do: {:error, Error.new(:bad_argument, "not a session: #{inspect(other, limit: 5)}")}

  defp close_here(id, timeout) do
    case Directory.started?() and Manager.forget(id) do
      {:ok, targets} ->
        deadline = Runtime.deadline(System.monotonic_time(:millisecond), timeout)

        targets
        |> Enum.map(fn {pid, _} ->
          req = close_request(id)
          Request.send_request(pid, req, :infinity, cancel_on_caller_exit: false)
        end)
        |> Enum.map(&Request.await(&1, deadline, on_timeout: :forget))
        |> Enum.find(:ok, &match?({:error, %Error{type: type}} when type != :worker_exit, &1))
        |> case do
          :ok ->
            :ok

          {:error, %Error{type: :timeout}} ->
            {:error,
             Error.new(
               :timeout,
               "session #{inspect(id)}: its worker did not answer close within #{timeout} ms " <>
                 "(busy); the close still runs when the worker gets to it, and the session " <>
                 "is forgotten here"
             )}

          {:error, e} ->
            {:error, e}
        end

      _none ->
        {:error,
         Directory.not_started(fn ->
           Error.new(:bad_argument, "unknown session #{inspect(id)} (not open, or closed)")
         end)}
    end
  end

  @doc """
  The session this process's calls default to, or `nil`: while `VllmBridge.with_session/2`
  or a `with_…` form (`VllmBridge.with_context/5`, the generated `with_…` bindings) runs
  its function, a call from the same process that names no `session_id` (and no other
  pool, and no other `node:`) runs in that session. `session_id: nil` opts a call out. Processes started inside
  the function (tasks) do not inherit it: pass them the session.
  """
  @spec current() :: t() | nil
  def current, do: Process.get(@current)

  @doc """
  Runs `fun.()` with `session` as this process's current session (see `current/0`), and
  puts the previous one back afterwards, also when `fun` raises.
  """
  @spec with_current(t(), (() -> result)) :: result when result: term()
  def with_current(%__MODULE__{} = session, fun) when is_function(fun, 0) do
    previous = Process.put(@current, session)

    try do
      fun.()
    after
      if previous, do: Process.put(@current, previous), else: Process.delete(@current)
    end
  end

  @doc false
  # The open session with this id.
  @spec lookup(String.t()) :: {:ok, t()} | {:error, Error.t()}
  def lookup(id) do
    case Directory.started?() and :ets.lookup(Directory.table(), {:session, id}) do
      [{_, session}] ->
        {:ok, session}

      _none ->
        {:error,
         Directory.not_started(fn ->
           Error.new(
             :bad_argument,
             "unknown session_id #{inspect(id)} (open it with VllmBridge.Session.open/1)"
           )
         end)}
    end
  end

  @doc false
  # The session's worker now, if it is still the process the session was opened on:
  # `{:ok, pid}`, or `:session_lost`.
  @spec home(t()) :: {:ok, pid()} | {:error, Error.t()}
  def home(%__MODULE__{pool: pool, worker: index, instance: instance} = s) do
    case Directory.worker(pool, index) do
      {pid, ^instance} -> {:ok, pid}
      _ -> {:error, lost(s)}
    end
  end

  @doc false
  @spec lost(t()) :: Error.t()
  def lost(%__MODULE__{} = s) do
    why =
      case Directory.down_reason(s.pool, s.worker, s.instance) do
        nil -> ""
        reason -> " (#{reason})"
      end

    Error.new(
      :session_lost,
      "session #{inspect(s.id)} lived on worker #{s.worker} of pool #{inspect(s.pool)} " <>
        "(instance #{s.instance}), which restarted or stopped#{why}; its state is gone"
    )
  end

  @doc false
  @spec close_request(String.t()) :: Request.t()
  def close_request(id), do: Request.new("close", pre: [Wire.value(id)], timed: false)

  defp check_keys(opts) when is_list(opts) do
    case Enum.find(opts, fn
           {k, _} -> k not in @open_keys
           _ -> true
         end) do
      nil ->
        :ok

      other ->
        {:error,
         Error.new(
           :bad_argument,
           "unknown session option #{inspect(other)}; known: #{inspect(@open_keys)}"
         )}
    end
  end

  defp check_keys(other),
    do:
      {:error,
       Error.new(:bad_argument, "session options must be a keyword list, got #{inspect(other)}")}

  defp pool_name(opts) do
    case Keyword.fetch(opts, :pool_name) do
      {:ok, name} ->
        {:ok, name}

      :error ->
        {:ok, Keyword.get(Application.get_env(:vllm_bridge, :runtime, []), :pool_name, :default)}
    end
  end

  defp pick(meta, nil) do
    loads =
      for i <- 0..(meta.size - 1), load = Slots.load(meta, i), load < Slots.down(), do: {load, i}

    case Enum.sort(loads) do
      [{_, i} | _] ->
        {:ok, i}

      [] ->
        {:error, Error.new(:worker_exit, "no worker of pool #{inspect(meta.name)} is serving")}
    end
  end

  defp pick(meta, i) when is_integer(i) and i >= 0 and i < meta.size, do: {:ok, i}

  defp pick(meta, other) do
    {:error,
     Error.new(
       :bad_argument,
       "worker must be an index in 0..#{meta.size - 1} of pool #{inspect(meta.name)}, got #{inspect(other)}"
     )}
  end

  defp instance(pool, index) do
    case Directory.worker(pool, index) do
      {_pid, instance} ->
        {:ok, instance}

      nil ->
        {:error,
         Error.new(
           :worker_exit,
           "worker #{index} of pool #{inspect(pool)} is not serving (restarting)"
         )}
    end
  end

  defp new_id(nil), do: {:ok, "s-" <> Base.encode16(:rand.bytes(8), case: :lower)}
  defp new_id(id) when is_binary(id) and byte_size(id) > 0, do: {:ok, id}

  defp new_id(other),
    do:
      {:error,
       Error.new(:bad_argument, "a session id must be a non-empty string, got #{inspect(other)}")}

  defp owner(pid) when is_pid(pid), do: {:ok, pid}

  defp owner(other),
    do: {:error, Error.new(:bad_argument, "owner must be a pid, got #{inspect(other)}")}
end
