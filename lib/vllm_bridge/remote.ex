defmodule VllmBridge.Remote do
  @moduledoc false
  # Pools on other BEAM nodes, on distributed Erlang alone (no cluster layer of ours):
  #
  #   * finding them: each pool's queue joins the `:pg` group `{:pool, name}` of the scope
  #     `VllmBridge.Pool.Groups` (VllmBridge.Pool.Queue), which the application starts on
  #     every node. `:pg` drops a member when its process exits (the pool stopped) and
  #     every member of a node when that node disconnects, so a node that goes leaves the
  #     routing by itself;
  #   * using them: a request routed to another node (VllmBridge.Call.Route answers
  #     `{:remote, node}`) runs there as the ordinary local request, in a process spawned
  #     on that node (VllmBridge.Remote.Proxy's runner), which this process monitors and
  #     whose watcher monitors this process. The local path is not touched: no pool process, no `:pg`
  #     look-up on it (only a pool missing here, a session or reference of another node,
  #     or `node:` pinning another node gets here).
  #
  # What holds across nodes, and why:
  #
  #   * one deadline: the proxy gets the milliseconds left when it is spawned and fixes
  #     the same deadline on its node's clock (monotonic clocks of two nodes are not
  #     comparable), so the remote worker is cancelled there at the deadline exactly as a
  #     local one, and the answer (a late success, or :timeout) comes back. This process
  #     waits for it up to @settle_margin past the deadline; past that (a node too busy
  #     to answer, a connection that hangs) it kills the runner, which cancels the request
  #     in its worker (the worker monitors its caller, that runner), and answers
  #     :timeout itself;
  #   * no late start: the proxy submits nothing before this process's go, sent on its
  #     spawn reply while this process still waits (spawn_proxy/3), so a spawn request
  #     that reaches a node after this process gave up on it (the node was stopped, the
  #     connection stalled) runs nothing there;
  #   * cancel: this process dying (or `Task.shutdown/2`) is seen by the proxy's watcher,
  #     which kills the runner that made the request: the worker sees its caller go and
  #     cancels the request, as for a local caller that dies;
  #   * a node going down: the monitor's `:noconnection` DOWN comes as soon as the
  #     connection drops; the request answers `:worker_exit` (`:session_lost` for a
  #     request in a session or on a reference) naming the node. The watcher's monitor of
  #     this process fires the same way on the other side, so the request is cancelled
  #     there too if that node lives on;
  #   * references: each `%VllmBridge.Ref{}` names the node it was decoded on (the
  #     pool's: VllmBridge.Codec.Ext), so requests on them are routed back; those made outside a session
  #     belong to this process on the remote node (its LooseRefs monitors this process),
  #     so they are released when this process exits or this node goes.

  alias VllmBridge.{Error, Ref}
  alias VllmBridge.Call.Runtime
  alias VllmBridge.Pool.Directory
  alias VllmBridge.Remote.Proxy

  @scope VllmBridge.Pool.Groups

  # How long past its deadline a request waits for the proxy's answer (the remote
  # worker's settle after its cancel is a message round trip; this bounds a node that
  # does not answer at all).
  @settle_margin 2_000

  @doc "The `:pg` scope pools join (started by the application)."
  @spec scope() :: atom()
  def scope, do: @scope

  @doc "How long past its deadline a request waits for a remote node's answer, in ms."
  @spec settle_margin() :: non_neg_integer()
  def settle_margin, do: @settle_margin

  @doc "The nodes where pool `name` runs (this one included), sorted."
  @spec nodes(term()) :: [node()]
  def nodes(name) do
    @scope
    |> :pg.get_members({:pool, name})
    |> Enum.map(&node/1)
    |> Enum.uniq()
    |> Enum.sort()
  rescue
    # The scope is not running: the application is not started.
    ArgumentError -> []
  end

  @doc """
  Where a request for a pool goes once this node does not serve it (no local pool, or
  `node:` names another node): `{:remote, node}`, or the error of a pool that is not
  started, naming the nodes that were looked at.
  """
  @spec pool_route(Runtime.t()) :: {:remote, node()} | {:error, Error.t()}
  def pool_route(%Runtime{pool_name: pool, node: pinned}) do
    others = nodes(pool) -- [node()]

    cond do
      pinned == nil and others != [] -> {:remote, Enum.random(others)}
      pinned == nil -> {:error, not_started(pool, nil)}
      pinned == node() -> {:error, not_started(pool, pinned)}
      pinned in others -> {:remote, pinned}
      true -> {:error, not_started(pool, pinned)}
    end
  end

  @doc "The error of pool `pool`, started neither here nor (pinned nil) on any connected node."
  @spec not_started(term(), node() | nil) :: Error.t()
  def not_started(pool, pinned) do
    Directory.not_started(fn ->
      where =
        case pinned do
          nil ->
            "on this node (running here: #{inspect(Directory.pools())}) nor on any " <>
              "connected node (looked at: #{inspect(Node.list())})"

          n when n == node() ->
            "on this node #{inspect(n)}, which node: pins (running here: " <>
              "#{inspect(Directory.pools())})"

          n ->
            connected = if n in Node.list(), do: "connected", else: "not connected"

            "on node #{inspect(n)}, which node: pins (#{connected}; nodes that have it: " <>
              "#{inspect(nodes(pool))})"
        end

      Error.new(:bad_argument, "pool #{inspect(pool)} is not started #{where}")
    end)
  end

  @doc """
  Whether a request pinned to `pinned` (`node:`) may use something of `owner_node` (a
  session or reference, described by `what`): `:ok`, or `:bad_argument` naming both.
  """
  @spec same_node(node() | nil, node(), String.t()) :: :ok | {:error, Error.t()}
  def same_node(nil, _owner_node, _what), do: :ok
  def same_node(n, n, _what), do: :ok

  def same_node(pinned, owner_node, what) do
    {:error,
     Error.new(
       :bad_argument,
       "#{what} lives on node #{inspect(owner_node)}, but node: #{inspect(pinned)} was given " <>
         "(its requests run on its own node)"
     )}
  end

  @doc """
  Refuses references of other nodes than `node` in `term` (the arguments of a request
  that runs on `node`): a worker there could not resolve them.
  """
  @spec refs_on(term(), node()) :: :ok | {:error, Error.t()}
  def refs_on(term, node) do
    case Enum.find(Ref.collect(term), &(Ref.node_of(&1) != node)) do
      nil ->
        :ok

      ref ->
        {:error,
         Error.new(
           :bad_argument,
           "reference #{ref.id} (#{ref.type}) lives on node #{inspect(Ref.node_of(ref))} " <>
             "and cannot be used by a request that runs on node #{inspect(node)}"
         )}
    end
  end

  @doc """
  Runs a request of `kind` (`VllmBridge.Call.Run.run/4`'s arguments) on `node`, in a
  proxy there, under `rt`'s deadline; `lost` is the error type of a node that goes down
  meanwhile (`:session_lost` in a session or on a reference, else `:worker_exit`).
  """
  @spec run(node(), Runtime.t(), String.t(), [iodata()], keyword(), atom()) ::
          {:ok, term()} | {:error, Error.t()}
  def run(node, %Runtime{} = rt, kind, parts, opts, lost) do
    payload = Keyword.get(opts, :payload)

    # (Arguments in this node's slots never come here: VllmBridge.Call.Run.run_encoded/4
    # runs a request on the route its tensors were encoded for, and only a route to a
    # pool of this node lends slots.)
    with :ok <- refs_on(payload, node) do
      # Only the references of the arguments travel for the remote route's :hint check
      # (VllmBridge.Call.Route.has_ref?/1); the arguments themselves are in `parts`.
      opts = if payload, do: Keyword.put(opts, :payload, Ref.collect(payload)), else: opts
      job = {:run, %{rt | deadline: nil}, Runtime.remaining(rt.deadline), kind, parts, opts}

      case spawn_proxy(node, job, rt.deadline) do
        {:ok, {pid, mref, reply}} -> await(pid, mref, reply, node, rt, kind, lost)
        {:error, reason} -> {:error, spawn_failed(node, reason, rt, kind, lost)}
      end
    end
  end

  @doc """
  Spawns the proxy of `job` on `node`, monitored, and tells it to go: `{:ok, {proxy,
  monitor, reply}}`, where `reply` is the alias its answers come on (deactivated by
  `done/2`, so that answers after this process gave up are dropped by the runtime);
  `{:error, reason}` when the node could not spawn it, or `{:error, :timeout}` when it
  did not say so before `deadline` and the margin (the request then never starts).

  The spawn is asynchronous (`:erlang.spawn_request/5`): `:erlang.spawn_opt/5` on another
  node waits for that node's reply with no limit, so a node that is up but does not
  answer (a stopped VM, a partition that closed no connection) held the caller past its
  deadline. A spawn request given up on is not withdrawn from the connection, though: a
  node that runs again before its connection is given up (`net_ticktime`) still spawns
  the proxy. So the proxy submits nothing before this process's go, which goes only on
  the proxy's spawn reply and only while this process still waits (its give-up time
  read on this node's clock when the reply is taken): a proxy spawned late exits having
  run nothing (VllmBridge.Remote.Proxy). The go costs a message round trip between the
  two nodes before the request starts.
  """
  @spec spawn_proxy(node(), tuple(), integer() | :infinity) ::
          {:ok, {pid(), reference(), reference()}} | {:error, term()}
  def spawn_proxy(node, job, deadline) do
    reply = :erlang.alias([:explicit_unalias])
    wait = wait_ms(deadline)
    # With :monitor the request's id is also the monitor's: the DOWN carries it.
    req = :erlang.spawn_request(node, Proxy, :start, [self(), reply, wait, job], [:monitor])

    case spawn_reply(req, reply, wait) do
      :timeout ->
        if :erlang.spawn_request_abandon(req) do
          :erlang.unalias(reply)
          {:error, :timeout}
        else
          # Its reply came between the timeout and the abandon: past the give-up time,
          # go/3 does not let it start.
          req |> spawn_reply(reply, :infinity) |> go(deadline)
        end

      answered ->
        go(answered, deadline)
    end
  end

  defp spawn_reply(req, reply, wait) do
    receive do
      {:spawn_reply, ^req, :ok, pid} ->
        {:ok, {pid, req, reply}}

      {:spawn_reply, ^req, :error, reason} ->
        :erlang.unalias(reply)
        {:error, reason}
    after
      wait -> :timeout
    end
  end

  # The give-up time is read again when the spawn reply is taken: a reply taken after it
  # (this process was descheduled, or this node stopped, between the reply's arrival and
  # now) starts nothing. The proxy, told no go, is killed rather than left to its wait.
  defp go({:ok, {pid, mref, reply}} = ok, deadline) do
    if deadline == :infinity or wait_ms(deadline) > 0 do
      send(pid, {:go, reply})
      ok
    else
      Process.exit(pid, :kill)
      done(mref, reply)
      {:error, :timeout}
    end
  end

  defp go(error, _deadline), do: error

  @doc "The error of a request whose proxy could not be spawned on `node` (`reason`)."
  @spec spawn_failed(node(), term(), Runtime.t(), String.t(), atom()) :: Error.t()
  def spawn_failed(node, :timeout, rt, kind, _lost) do
    # A stream's spawn is given up on at its first chunk's time (VllmBridge.Remote.Stream).
    within =
      if kind == "stream",
        do:
          "its first chunk's time (timeout #{ms(rt.timeout)}, stream_timeout #{ms(rt.stream_timeout)})",
        else: "its timeout (#{ms(rt.timeout)})"

    Error.new(
      :timeout,
      "#{kind} on node #{inspect(node)}: the node did not start the request within " <>
        "#{within} and #{@settle_margin} ms more; it was withdrawn and will not run " <>
        "there, even if the node answers again"
    )
  end

  def spawn_failed(node, reason, _rt, kind, lost), do: down(node, reason, lost, "#{kind}")

  defp ms(:infinity), do: ":infinity"
  defp ms(ms), do: "#{ms} ms"

  @doc "Stops listening to a proxy: its monitor and alias go, and what they brought."
  @spec done(reference(), reference()) :: :ok
  def done(mref, reply) do
    :erlang.unalias(reply)
    Process.demonitor(mref, [:flush])
    flush(reply)
  end

  defp flush(reply) do
    receive do
      {^reply, _} -> flush(reply)
      {^reply, _, _} -> flush(reply)
    after
      0 -> :ok
    end
  end

  defp await(pid, mref, reply, node, rt, kind, lost) do
    receive do
      {^reply, :result, result} ->
        done(mref, reply)
        result

      {:DOWN, ^mref, :process, _pid, reason} ->
        done(mref, reply)
        {:error, down(node, reason, lost, "#{kind}")}
    after
      wait_ms(rt.deadline) ->
        Process.exit(pid, :kill)
        done(mref, reply)

        {:error,
         Error.new(
           :timeout,
           "#{kind} on node #{inspect(node)}: no answer within its timeout " <>
             "(#{rt.timeout} ms) and #{@settle_margin} ms more; it was cancelled there"
         )}
    end
  end

  @doc "How long to wait for a proxy's answer before `deadline` plus the margin."
  @spec wait_ms(integer() | :infinity) :: timeout()
  def wait_ms(:infinity), do: :infinity

  # One give-up time, the deadline plus the margin, whichever wait asks (the spawn's, then
  # the answer's): not the margin again after each.
  def wait_ms(deadline),
    do: max(deadline + @settle_margin - :erlang.monotonic_time(:millisecond), 0)

  @doc "The error of a request whose proxy on `node` went down with `reason`."
  @spec down(node(), term(), atom(), String.t()) :: Error.t()
  def down(node, :noconnection, lost, what) do
    Error.new(
      lost,
      "#{what} on node #{inspect(node)}: the node went down or lost its connection " <>
        "(noconnection) before it answered"
    )
  end

  def down(node, :noproc, lost, what) do
    Error.new(lost, "#{what} on node #{inspect(node)}: the node could not be reached (noproc)")
  end

  # Its proxy never got the go: the go was on its way when the wait the proxy was given
  # ran out on that node (the node was stopped, or the connection stalled, in between).
  def down(node, :not_started, _lost, what) do
    Error.new(
      :timeout,
      "#{what} on node #{inspect(node)}: the node did not start the request before its " <>
        "timeout and #{@settle_margin} ms more had passed there; it did not run"
    )
  end

  def down(node, reason, _lost, what) do
    Error.new(
      :worker_exit,
      "#{what} on node #{inspect(node)}: its proxy's runner exited " <>
        "(#{inspect(reason, limit: 8)}) before it answered"
    )
  end
end
