defmodule VllmBridge.Session.Remote do
  @moduledoc false
  # The sessions of other nodes (VllmBridge.Session): opened and closed there, by
  # `:erpc`, and known here too (VllmBridge.Session.Manager), so that requests naming
  # them by id are routed there and their owner's exit forgets them here.

  alias VllmBridge.{Error, Session}
  alias VllmBridge.Call.Runtime
  alias VllmBridge.Session.Manager

  # How long opening or closing a session on another node may wait for that node, at
  # least (a close waits its own timeout, and this more).
  @remote_ms 5_000

  # This node's pool, or the node to open the session on (as a request would pick it),
  # with the options that open it there.
  @doc false
  @spec where(term(), node() | nil, keyword()) ::
          {:local, VllmBridge.Pool.Meta.t()} | {:remote, node(), keyword()} | {:error, Error.t()}
  def where(pool, pinned, opts) do
    case VllmBridge.Pool.meta(pool) do
      {:ok, meta} when pinned == nil or pinned == node() ->
        {:local, meta}

      _elsewhere ->
        case VllmBridge.Remote.pool_route(%Runtime{pool_name: pool, node: pinned}) do
          {:remote, n} ->
            opts = opts |> Keyword.put(:node, n) |> Keyword.put_new(:owner, self())
            {:remote, n, Keyword.put_new(opts, :pool_name, pool)}

          {:error, e} ->
            {:error, e}
        end
    end
  end

  # Opened on `node` (its manager watches the owner from there), and known here too, so
  # that requests naming it by id are routed there and the owner's exit forgets it here.
  @doc false
  @spec open_on(node(), keyword()) :: {:ok, Session.t()} | {:error, Error.t()}
  def open_on(node, opts) do
    id = Keyword.fetch!(opts, :id)

    with {:ok, %Session{} = s} <- open_there(node, opts, id) do
      case Manager.register(s) do
        {:ok, s} ->
          {:ok, s}

        {:error, e} ->
          _ = remote(node, :close, [s.id, @remote_ms], @remote_ms * 2, "close")
          {:error, e}
      end
    end
  end

  # An open with no answer in time may still open the session there: it is closed there
  # once it is open (close_stray/2), rather than left to its owner's exit.
  defp open_there(node, opts, id) do
    case remote(node, :open, [opts], @remote_ms, "open") do
      {:error, %Error{type: :timeout}} = error ->
        :erpc.cast(node, __MODULE__, :close_stray, [id, @remote_ms * 2])
        error

      other ->
        other
    end
  end

  @doc false
  # Closes session `id` of this node once it is open, waiting up to `within` ms for it
  # (an open from another node that timed out there may still be on its way).
  @spec close_stray(String.t(), non_neg_integer()) :: :ok
  def close_stray(id, within) do
    if VllmBridge.Await.until(fn -> match?({:ok, _}, Session.lookup(id)) end, within, 100),
      do: _ = Session.close(id)

    :ok
  end

  # Session.open/1 or Session.close/2 on `node`.
  defp remote(node, fun, args, timeout, what) do
    :erpc.call(node, Session, fun, args, timeout)
  catch
    :error, {:erpc, :noconnection} ->
      {:error,
       Error.new(
         :worker_exit,
         "session #{what} on node #{inspect(node)}: the node is not reachable",
         details: %{noconnection: true}
       )}

    :error, {:erpc, :timeout} ->
      {:error,
       Error.new(:timeout, "session #{what} on node #{inspect(node)}: no answer in #{timeout} ms")}

    # Not the node gone: a failure there (an undef from a node running another version
    # of vllm_bridge, say), which a close must not take for done.
    class, reason ->
      {:error,
       Error.new(
         :protocol,
         "session #{what} on node #{inspect(node)} failed there (are both nodes running " <>
           "the same vllm_bridge?): #{inspect({class, reason}, limit: 8)}"
       )}
  end

  @doc false
  @spec forget_lost(String.t()) :: :ok
  def forget_lost(id) do
    _ = Manager.forget(id)
    :ok
  end

  @doc false
  # The error of a session of `node` (or a request naming it there) that was closed
  # there when the connection between the two nodes dropped.
  @spec lost_with_node(String.t(), node(), node()) :: Error.t()
  def lost_with_node(id, node, other) do
    Error.new(
      :session_lost,
      "session #{inspect(id)} lived on node #{inspect(node)}, whose connection with node " <>
        "#{inspect(other)} dropped (a node went down, or a netsplit); it was closed there " <>
        "and its state is gone"
    )
  end

  # Forgotten here, closed there; a node that is gone took the session with it.
  @doc false
  @spec close_on(node(), String.t(), timeout()) :: :ok | {:error, Error.t()}
  def close_on(node, id, timeout) do
    _ = Manager.forget(id)
    budget = if timeout == :infinity, do: :infinity, else: timeout + @remote_ms

    case remote(node, :close, [id, timeout], budget, "close") do
      # Only a node that is gone took the session with it.
      {:error, %Error{details: %{noconnection: true}}} -> :ok
      other -> other
    end
  end
end
