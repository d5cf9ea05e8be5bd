defmodule VllmBridge.PeerHelpers do
  @moduledoc false
  # Peer BEAM nodes for the distribution tests (test/distribution): OTP's `:peer` on
  # 127.0.0.1 only, each node running this build's code (the test node's code path) and
  # the :vllm_bridge application with the test node's configuration, so that it starts
  # real Python workers from the same virtual environment (the OS environment, with
  # VLLM_BRIDGE_PYTHON when set, is inherited by the peer).

  @doc """
  Why distributed Erlang cannot run here (no `epmd` executable), or nil: for a test
  module's `@moduletag skip:`, checked when it compiles, without starting anything.
  """
  @spec unavailable() :: String.t() | nil
  def unavailable do
    if System.find_executable("epmd"), do: nil, else: "no epmd executable on PATH"
  end

  @doc """
  Makes this node distributed (`vbtest…@127.0.0.1`, long names) if it is not, its
  distribution listener bound to 127.0.0.1 only: starts epmd first, listening on
  127.0.0.1 only (`ERL_EPMD_ADDRESS`; `epmd -daemon` returns at once when one runs, and
  may return before a new one listens: the start is tried a few times). The node's
  cookie is the default one (`~/.erlang.cookie`), which the peers read too.
  """
  @spec ensure_distributed() :: :ok | {:error, term()}
  def ensure_distributed do
    if Node.alive?() do
      :ok
    else
      _ =
        System.cmd("epmd", ["-daemon"],
          env: [{"ERL_EPMD_ADDRESS", "127.0.0.1"}],
          stderr_to_stdout: true
        )

      Application.put_env(:kernel, :inet_dist_use_interface, {127, 0, 0, 1})
      start_node(:"vbtest#{System.unique_integer([:positive])}@127.0.0.1", 10)
    end
  rescue
    e -> {:error, Exception.message(e)}
  end

  defp start_node(name, tries) do
    case Node.start(name, :longnames) do
      {:ok, _} ->
        :ok

      {:error, _} = error ->
        cond do
          Node.alive?() -> :ok
          tries > 1 -> retry_start(name, tries - 1)
          true -> error
        end
    end
  end

  @doc """
  Starts a peer node named `name`@127.0.0.1 (not linked to the caller: a test may kill
  it) with the :vllm_bridge application running: `{peer, node}`. `connection:
  :standard_io` controls it over its standard input and output (it then survives
  `Node.disconnect/1`; `:peer.call/4` reaches it while disconnected).
  """
  @spec start_peer!(atom(), keyword()) :: {pid(), node()}
  def start_peer!(name, opts \\ []) do
    :ok = ensure_distributed()
    paths = Enum.flat_map(:code.get_path(), &[~c"-pa", &1])

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
          args:
            cookie_args() ++ [~c"-kernel", ~c"inet_dist_use_interface", ~c"{127,0,0,1}"] ++ paths
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

  defp retry_start(name, tries) do
    Process.sleep(200)
    start_node(name, tries)
  end

  # The peer reads ~/.erlang.cookie as this node did: no cookie on its command line
  # (where `ps` shows it), unless this node was given another one (then it must be).
  defp cookie_args do
    file = Path.join(System.user_home!(), ".erlang.cookie")

    case File.read(file) do
      {:ok, c} when c != "" ->
        if String.trim(c) == Atom.to_string(Node.get_cookie()),
          do: [],
          else: [~c"-setcookie", Atom.to_charlist(Node.get_cookie())]

      _ ->
        [~c"-setcookie", Atom.to_charlist(Node.get_cookie())]
    end
  end

  @doc "Stops a peer if it still runs."
  @spec stop_peer(pid()) :: :ok
  def stop_peer(peer) do
    :peer.stop(peer)
  catch
    :exit, _ -> :ok
  end

  @doc "Starts pool `name` on `node` (options as `VllmBridge.start_pool/2`)."
  @spec start_pool_on!(node(), atom(), keyword()) :: :ok
  def start_pool_on!(node, name, opts) do
    {:ok, _} = :erpc.call(node, VllmBridge, :start_pool, [name, opts], 120_000)
    :ok
  end

  @doc "The OS pids of the workers of pool `name` on `node`."
  @spec os_pids_on(node(), atom()) :: [pos_integer()]
  def os_pids_on(node, name) do
    {:ok, ws} = :erpc.call(node, VllmBridge.Pool, :workers, [name])
    for %{os_pid: p} <- ws, do: p
  end

  @doc "The OS pid of `node`'s BEAM."
  @spec beam_os_pid(node()) :: pos_integer()
  def beam_os_pid(node), do: :erpc.call(node, :os, :getpid, []) |> List.to_integer()

  @typedoc "A stopped BEAM: its OS pid, and the process that resumes it at the latest."
  @type frozen :: {pos_integer(), pid()}

  @doc """
  Stops the BEAM of OS pid `os_pid` (SIGSTOP: a frozen node, its connections left open)
  until `thaw/1`, and at the latest `limit` ms from now whatever becomes of the caller (a
  test that fails, or a call that waits on the stopped node, must not leave it stopped).
  Take the OS pid (`beam_os_pid/1`) before: the node answers nothing once stopped.
  Returns once the OS says the process is stopped: a signal is delivered when the
  process next runs, and on a busy machine a node that ran on a little could take a
  request sent after `kill` returned (the window DEPLOYMENT.md, "Netsplits", describes).
  """
  @spec freeze(pos_integer(), pos_integer()) :: frozen()
  def freeze(os_pid, limit \\ 10_000) do
    {_, 0} = System.cmd("kill", ["-STOP", "#{os_pid}"])

    net =
      spawn(fn ->
        Process.sleep(limit)
        System.cmd("kill", ["-CONT", "#{os_pid}"])
      end)

    frozen = {os_pid, net}
    await_stopped(frozen, 500)
    frozen
  end

  defp await_stopped(frozen, tries) do
    cond do
      frozen?(frozen) ->
        :ok

      tries == 0 ->
        raise "the BEAM of OS pid #{elem(frozen, 0)} did not stop after SIGSTOP"

      true ->
        Process.sleep(10)
        await_stopped(frozen, tries - 1)
    end
  end

  @doc "Resumes a BEAM stopped by `freeze/2` (SIGCONT)."
  @spec thaw(frozen()) :: :ok
  def thaw({os_pid, net}) do
    Process.exit(net, :kill)
    System.cmd("kill", ["-CONT", "#{os_pid}"])
    :ok
  end

  @doc "Whether a BEAM stopped by `freeze/2` is still stopped (every thread's OS state is T)."
  @spec frozen?(frozen()) :: boolean()
  def frozen?({os_pid, _net}) do
    {out, 0} = System.cmd("ps", ["-L", "-o", "state=", "-p", "#{os_pid}"])
    states = String.split(out)
    states != [] and Enum.all?(states, &(&1 == "T"))
  end

  @doc """
  Runs `fun` while `node`'s BEAM is stopped (`freeze/2`; resumed when `fun` returns or
  raises, or `limit` ms after the stop): `{fun's result, whether the node was still
  stopped when fun returned}` (false: `fun` waited for the node to run again).
  """
  @spec while_frozen(node(), (() -> result), pos_integer()) :: {result, boolean()}
        when result: term()
  def while_frozen(node, fun, limit \\ 10_000) do
    frozen = node |> beam_os_pid() |> freeze(limit)

    try do
      result = fun.()
      {result, frozen?(frozen)}
    after
      thaw(frozen)
    end
  end

  @doc """
  The remote requests' proxies (VllmBridge.Remote.Proxy's runners) alive on `node`: none
  once every request sent there has run, or given up waiting for its go.
  """
  @spec proxies_on(node()) :: [pid()]
  def proxies_on(node) do
    for pid <- :erpc.call(node, :erlang, :processes, []),
        match?(
          {:initial_call, {VllmBridge.Remote.Proxy, :start, _}},
          :erpc.call(node, :erlang, :process_info, [pid, :initial_call])
        ),
        do: pid
  end
end
