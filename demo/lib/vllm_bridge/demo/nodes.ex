defmodule VllmBridge.Demo.Nodes do
  @moduledoc """
  A second BEAM node on this machine for `mix vllm.demo --nodes 2` (and the tests of DP
  across nodes): OTP's `:peer` over loopback, given this node's code paths and the
  `:vllm_bridge` application's environment (the Python interpreter among it), with the
  application started there, so pools can be started on it with `:erpc`.

  This node becomes distributed first if it is not (`Node.start/2` as
  `vllm_demo_<n>@127.0.0.1`, long names, after `epmd -daemon`); a node that already is
  keeps its name, and the peer takes the same kind of name on the same host.

  `call/3` is the one place where a rank's calls reach the node its pool runs on.
  """

  alias VllmBridge.Error

  @enforce_keys [:pid, :node]
  defstruct [:pid, :node, started_distribution: false]

  @typedoc "A started peer node: its `:peer` process and its node name."
  @type t :: %__MODULE__{pid: pid(), node: node(), started_distribution: boolean()}

  @host "127.0.0.1"

  @doc """
  Starts a peer node named `name` (an atom; the host is this node's) and starts the
  `:vllm_bridge` application on it. Makes this node distributed first if needed.
  """
  @spec start_peer(atom()) :: {:ok, t()} | {:error, Error.t()}
  def start_peer(name) do
    with {:ok, started?} <- ensure_distributed() do
      [_, host] = node() |> Atom.to_string() |> String.split("@", parts: 2)

      peer_opts = %{
        name: name,
        host: String.to_charlist(host),
        longnames: String.contains?(host, "."),
        args: [~c"-setcookie", Atom.to_charlist(Node.get_cookie())]
      }

      case :peer.start(peer_opts) do
        {:ok, pid, peer} ->
          %__MODULE__{pid: pid, node: peer, started_distribution: started?}
          |> set_up()

        {:error, reason} ->
          {:error,
           Error.new(:worker_exit, "cannot start the peer node #{name}: #{inspect(reason)}")}
      end
    end
  end

  # The peer gets this node's code paths and application environment, then the app.
  defp set_up(%__MODULE__{node: peer} = nodes) do
    # Logger's too (its levels); each application loaded first, since loading one sets
    # its environment to its .app file's defaults.
    env = for app <- [:logger, :vllm_bridge], do: {app, Application.get_all_env(app)}
    :ok = :erpc.call(peer, :code, :add_pathsa, [:code.get_path()])
    for {app, _} <- env, do: :ok = :erpc.call(peer, Application, :load, [app])
    :ok = :erpc.call(peer, Application, :put_all_env, [env])

    case :erpc.call(peer, Application, :ensure_all_started, [:vllm_bridge]) do
      {:ok, _} ->
        {:ok, nodes}

      {:error, reason} ->
        stop_peer(nodes)

        {:error,
         Error.new(:worker_exit, "vllm_bridge did not start on #{peer}: #{inspect(reason)}")}
    end
  end

  @doc """
  Makes this node distributed (long names on #{@host}, after `epmd -daemon`) unless it is
  already: `{:ok, true}` when this call started it.
  """
  @spec ensure_distributed() :: {:ok, boolean()} | {:error, Error.t()}
  def ensure_distributed do
    if Node.alive?() do
      {:ok, false}
    else
      # epmd (port 4369) must run for a named node (Node.start/2 does not start it, as
      # `erl -name` does); -daemon is a no-op when it runs.
      case epmd() do
        nil -> :ok
        epmd -> System.cmd(epmd, ["-daemon"], stderr_to_stdout: true)
      end

      name = :"vllm_demo_#{System.unique_integer([:positive])}@#{@host}"

      case Node.start(name, :longnames) do
        {:ok, _} ->
          {:ok, true}

        {:error, reason} ->
          {:error,
           Error.new(
             :worker_exit,
             "cannot make this node distributed as #{name}: #{inspect(reason)}"
           )}
      end
    end
  end

  # On PATH, else in the running ERTS's bin folder (where OTP installs it).
  defp epmd do
    System.find_executable("epmd") ||
      Path.wildcard(Path.join([:code.root_dir(), "erts-*", "bin", "epmd"])) |> List.first()
  end

  @doc """
  Stops the peer node (its pools and their Python processes go with it), and this node's
  distribution if `start_peer/1` started it.
  """
  @spec stop_peer(t()) :: :ok
  def stop_peer(%__MODULE__{pid: pid, started_distribution: started?}) do
    _ =
      try do
        :peer.stop(pid)
      catch
        :exit, _ -> :ok
      end

    if started?, do: Node.stop()
    :ok
  end

  @doc """
  Runs `fun.(runtime_opts)` for a rank whose pool runs on `node`: here when `node` is this
  node, else on `node` through `:erpc` (the binding, its session and pool all live
  there). Returns what `fun` returns; a node that is gone or does not answer within
  `timeout` ms is `{:error, %VllmBridge.Error{type: :worker_exit}}`.
  """
  @spec call(node(), (keyword() -> result), keyword(), timeout()) ::
          result | {:error, Error.t()}
        when result: term()
  def call(node, fun, runtime_opts, timeout \\ :infinity)

  def call(node, fun, runtime_opts, _timeout) when node == node(), do: fun.(runtime_opts)

  def call(node, fun, runtime_opts, timeout) do
    :erpc.call(node, fn -> fun.(runtime_opts) end, timeout)
  catch
    :error, {:erpc, reason} ->
      {:error, Error.new(:worker_exit, "the call to node #{node} failed: #{inspect(reason)}")}

    # What raised on the other node raises here.
    :error, {:exception, reason, stack} ->
      reraise Exception.normalize(:error, reason, stack), stack
  end
end
