defmodule VllmBridge.PeerHelpers do
  @moduledoc false
  # Peer BEAM nodes for the distribution tests (test/distribution): OTP's `:peer` on
  # 127.0.0.1 only, each node running this build's code (the test node's code path) and
  # the :vllm_bridge application with the test node's configuration, so that it starts
  # real Python workers from the same virtual environment (the OS environment, with
  # VLLM_BRIDGE_PYTHON when set, is inherited by the peer).

  @doc """
  Makes this node distributed (`test@127.0.0.1`, long names) if it is not: starts epmd
  first (`epmd -daemon` returns at once when one runs). `{:error, why}` when distribution
  cannot start here.
  """
  def ensure_distributed do
    if Node.alive?() do
      :ok
    else
      _ = System.cmd("epmd", ["-daemon"], stderr_to_stdout: true)
      name = :"vbtest#{System.unique_integer([:positive])}@127.0.0.1"

      case Node.start(name, :longnames) do
        {:ok, _} -> :ok
        # Another test file's compilation (they compile side by side) started it first.
        {:error, _} = error -> if Node.alive?(), do: :ok, else: error
      end
    end
  rescue
    e -> {:error, Exception.message(e)}
  end

  @doc """
  Starts a peer node named `name`@127.0.0.1 (not linked to the caller: a test may kill
  it) with the :vllm_bridge application running: `{peer, node}`. `connection:
  :standard_io` controls it over its standard input and output (it then survives
  `Node.disconnect/1`; `:peer.call/4` reaches it while disconnected).
  """
  def start_peer!(name, opts \\ []) do
    :ok = ensure_distributed()
    paths = Enum.flat_map(:code.get_path(), &[~c"-pa", &1])
    cookie = Atom.to_charlist(Node.get_cookie())

    # With connection: :standard_io the peer is controlled over its standard input and
    # output, so it outlives a dropped distribution connection (the default control
    # connection is the distribution one: the peer halts when it drops).
    control = if opts[:connection], do: %{connection: opts[:connection]}, else: %{}

    {:ok, peer, node} =
      :peer.start(
        Map.merge(control, %{
          name: :"#{name}#{System.unique_integer([:positive])}",
          host: ~c"127.0.0.1",
          longnames: true,
          args: [~c"-setcookie", cookie | paths]
        })
      )

    true = Node.connect(node)

    # What config/*.exs gave this node (the python interpreter, ...).
    for {k, v} <- Application.get_all_env(:vllm_bridge),
        do: :ok = :erpc.call(node, Application, :put_env, [:vllm_bridge, k, v])

    {:ok, _} = :erpc.call(node, Application, :ensure_all_started, [:vllm_bridge])
    # Its console (which the peer forwards to this one) shows warnings and errors only,
    # as this node's does under test (config/test.exs).
    :ok = :erpc.call(node, Logger, :configure, [[level: :warning]])
    {peer, node}
  end

  @doc "Stops a peer if it still runs."
  def stop_peer(peer) do
    :peer.stop(peer)
  catch
    :exit, _ -> :ok
  end

  @doc "Starts pool `name` on `node` (options as `VllmBridge.start_pool/2`)."
  def start_pool_on!(node, name, opts) do
    {:ok, _} = :erpc.call(node, VllmBridge, :start_pool, [name, opts], 120_000)
    :ok
  end

  @doc "The OS pids of the workers of pool `name` on `node`."
  def os_pids_on(node, name) do
    {:ok, ws} = :erpc.call(node, VllmBridge.Pool, :workers, [name])
    for %{os_pid: p} <- ws, do: p
  end

  @doc "The OS pid of `node`'s BEAM."
  def beam_os_pid(node), do: :erpc.call(node, :os, :getpid, []) |> List.to_integer()
end
