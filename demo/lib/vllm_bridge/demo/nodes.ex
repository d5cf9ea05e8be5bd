defmodule VllmBridge.Demo.Nodes do
  @moduledoc """
  A second BEAM node on this machine for `mix vllm.demo --nodes 2` (and the tests of DP
  across nodes): OTP's `:peer` over loopback, given this node's code paths and the
  `:vllm_bridge` application's environment (the Python interpreter among it), with the
  application started there, so pools can be started on it with `:erpc`.

  This node becomes distributed first if it is not (`Node.start/2` as
  `vllm_demo_<n>@127.0.0.1`, long names, after `epmd -daemon`); a node that already is
  keeps its name, and the peer takes the same kind of name on the same host.

  Only pools are started and stopped through `:erpc` (`stop_pool/2`); a rank's calls go
  through the bindings from the demo's node, routed to the peer's pool by its session.
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
        args: cookie_args() ++ loopback_args(host)
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
        nil ->
          :ok

        epmd ->
          System.cmd(epmd, ["-daemon"], env: [{"ERL_EPMD_ADDRESS", @host}], stderr_to_stdout: true)
      end

      name = :"vllm_demo_#{System.unique_integer([:positive])}@#{@host}"
      # The listener on loopback only, as an epmd started above (one that already ran
      # keeps the addresses it was started with).
      Application.put_env(:kernel, :inet_dist_use_interface, {127, 0, 0, 1})

      case start_node(name, 10) do
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

  # A new epmd may not listen yet when `epmd -daemon` returns: a few tries.
  defp start_node(name, tries) do
    case Node.start(name, :longnames) do
      {:error, _} when tries > 1 ->
        Process.sleep(200)
        start_node(name, tries - 1)

      other ->
        other
    end
  end

  # The cookie stays off the peer's command line (where `ps` shows it) when the peer
  # reads the same one from ~/.erlang.cookie, as a node does by default.
  defp cookie_args do
    cookie = Atom.to_string(Node.get_cookie())

    case File.read(Path.join(System.user_home!(), ".erlang.cookie")) do
      {:ok, c} when c != "" -> if String.trim(c) == cookie, do: [], else: setcookie(cookie)
      _ -> setcookie(cookie)
    end
  end

  defp setcookie(cookie), do: [~c"-setcookie", String.to_charlist(cookie)]

  defp loopback_args("127.0.0.1"), do: [~c"-kernel", ~c"inet_dist_use_interface", ~c"{127,0,0,1}"]
  defp loopback_args(_host), do: []

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
  Stops the pool `pool` on `node` (pools are started and stopped where they run); a node
  that is gone has nothing left to stop.
  """
  @spec stop_pool(node(), atom()) :: :ok | {:error, term()}
  def stop_pool(node, pool) do
    :erpc.call(node, VllmBridge, :stop_pool, [pool], 30_000)
  catch
    :error, {:erpc, reason} -> {:error, reason}
  end
end
