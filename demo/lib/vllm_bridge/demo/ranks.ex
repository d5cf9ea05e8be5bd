defmodule VllmBridge.Demo.Ranks do
  @moduledoc """
  The demo's data-parallel ranks: Python workers as DP ranks, one session pinned to each.

  On one node (the default) one pool's worker `i` is DP rank `i`. With `nodes: 2`, rank
  0's pool (one worker) runs on this node and rank 1's on a second BEAM node started on
  this machine (`VllmBridge.Demo.Nodes`); the two pools join one group because each is
  given the same rendezvous with its own rank (the pool option `dp:`,
  `VllmBridge.DP.Rendezvous`): `master_addr` 127.0.0.1, a free local port where rank 0
  hosts the store, `backend: "gloo"` (the DP collectives go through the CPU: two NCCL
  ranks cannot share one GPU, and the step's agreement runs on the CPU anyway). Each
  worker's environment also sets `VLLM_LOG_BATCHSIZE_INTERVAL` (batch-size tracking on)
  and `OMP_NUM_THREADS=1` (the ranks share the machine's cores; torch's thread pool would
  otherwise oversubscribe them).

  Calls go through the generated bindings from this node (`run!/4` hands them the rank's
  session and the `:ml_inference` timeout profile): rank 1's session was opened on the
  peer node (`Session.open(node: peer)`), so its calls run there (`VllmBridge`, "Across
  nodes") with nothing in the demo that knows it.
  `both/2` runs one function per rank concurrently (one task per rank): the DP
  collectives need every rank inside the same call at once.
  """

  alias VllmBridge.{Error, Session}
  alias VllmBridge.Demo.Nodes
  alias Vllm.Demo.Rank.Module, as: Runner

  @enforce_keys [:pool, :sessions, :size, :master_port]
  defstruct [:pool, :sessions, :size, :master_port, nodes: [], peer: nil]

  @typedoc """
  The pool name, one session per rank (by rank), the DP size and master port, the node
  each rank's pool runs on (by rank) and the peer node started for them (or `nil`).
  """
  @type t :: %__MODULE__{
          pool: atom(),
          sessions: [Session.t()],
          size: pos_integer(),
          master_port: :inet.port_number(),
          nodes: [node()],
          peer: Nodes.t() | nil
        }

  @call_timeout_ms 600_000

  # The runner is not on the workers' default allow-list (it writes and reads files at
  # paths its caller names): the demo's pools, and only they, allow it.
  @modules ["vllm_bridge.demo.rank"]

  @doc """
  Starts the DP ranks and opens a session on each: pool `pool` of `size` workers here,
  or with `nodes: 2` (`size` must then be 2) rank 0's pool here and rank 1's on a peer
  node. While the workers start (importing torch takes seconds), `progress` is called
  here with lines to show: each rank as it is ready, and every 2 s the ranks still
  starting, from the pools' own `:progress` reports (`VllmBridge.Pool.Options`).
  """
  @spec start(atom(), pos_integer(), (String.t() -> any()), keyword()) ::
          {:ok, t()} | {:error, Error.t()}
  def start(pool, size, progress, opts \\ []) do
    port = free_port()
    dp = [master_addr: "127.0.0.1", master_port: port, world_size: size, backend: "gloo"]

    case Keyword.get(opts, :nodes, 1) do
      1 ->
        start_here(pool, size, port, dp, progress)

      2 when size == 2 ->
        start_on_two_nodes(pool, port, dp, progress)

      n ->
        {:error, Error.new(:bad_argument, "nodes: must be 1 or 2 (2 ranks), got #{inspect(n)}")}
    end
  end

  defp start_here(pool, size, port, dp, progress) do
    opts = pool_opts(Keyword.put(dp, :ranks, 0..(size - 1)), &report(&1, progress, 0))

    with {:ok, _} <- VllmBridge.start_pool(pool, opts),
         {:ok, sessions} <- open_sessions(pool, size) do
      {:ok,
       %__MODULE__{
         pool: pool,
         sessions: sessions,
         size: size,
         master_port: port,
         nodes: List.duplicate(node(), size)
       }}
    end
  end

  # Rank 1's pool on a peer node: its progress lines come back here through a relay
  # (the callback runs there and cannot call a function that exists only here). Pools
  # are started where they run (`:erpc`); its session is opened from here, on the
  # peer's pool, and owned by this process (it closes there if the demo dies).
  defp start_on_two_nodes(pool, port, dp, progress) do
    with {:ok, peer} <- Nodes.start_peer(:"vllm_demo_rank1_#{System.unique_integer([:positive])}") do
      relay = spawn_link(fn -> relay(progress) end)

      result =
        with {:ok, _} <-
               VllmBridge.start_pool(
                 pool,
                 pool_opts(Keyword.put(dp, :ranks, [0]), &report(&1, progress, 0))
               ),
             {:ok, _} <-
               :erpc.call(peer.node, VllmBridge.Pool, :start, [
                 pool,
                 pool_opts(Keyword.put(dp, :ranks, [1]), {__MODULE__, :report_to, [relay, 1]})
               ]),
             {:ok, s0} <- Session.open(pool_name: pool, worker: 0),
             {:ok, s1} <-
               Session.open(pool_name: pool, worker: 0, node: peer.node) do
          {:ok,
           %__MODULE__{
             pool: pool,
             sessions: [s0, s1],
             size: 2,
             master_port: port,
             nodes: [node(), peer.node],
             peer: peer
           }}
        end

      send(relay, :done)

      with {:error, _} <- result do
        _ = VllmBridge.stop_pool(pool)
        Nodes.stop_peer(peer)
        result
      end
    end
  end

  defp relay(progress) do
    receive do
      {:line, line} ->
        progress.(line)
        relay(progress)

      :done ->
        :ok
    end
  end

  @doc false
  # The :progress callback of a pool on another node: its lines go to `relay` here.
  @spec report_to(map(), pid(), non_neg_integer()) :: any()
  def report_to(info, relay, first_rank),
    do: report(info, &send(relay, {:line, &1}), first_rank)

  defp pool_opts(dp, progress) do
    [
      size: length(Enum.to_list(dp[:ranks])),
      modules: @modules,
      progress: progress,
      dp: dp,
      worker_env: [{"VLLM_LOG_BATCHSIZE_INTERVAL", 3600}, {"OMP_NUM_THREADS", 1}]
    ]
  end

  @doc false
  # One worker's start report (called in that worker's process): a line for a rank that
  # is ready, and one per rank every 2 s while it imports or runs its on_start.
  @spec report(map(), (String.t() -> any()), non_neg_integer()) :: any()
  def report(info, progress, first_rank \\ 0)

  def report(%{stage: :ready} = info, progress, first_rank) do
    progress.(
      "  [#{secs(info.elapsed_ms)}] rank #{first_rank + info.index} ready: os pid #{info.os_pid}, " <>
        "device #{info.device}"
    )
  end

  def report(%{stage: :waiting} = info, progress, first_rank) do
    doing = if info.waiting_for == :handshake, do: "importing", else: "running its on_start"

    progress.(
      "  [#{secs(info.elapsed_ms)}] rank #{first_rank + info.index} still starting (#{doing})"
    )
  end

  def report(_info, _progress, _first_rank), do: :ok

  defp secs(ms), do: :io_lib.format("~5.1fs", [ms / 1000]) |> IO.iodata_to_binary()

  defp open_sessions(pool, size) do
    Enum.reduce_while(0..(size - 1), {:ok, []}, fn rank, {:ok, acc} ->
      case Session.open(pool_name: pool, worker: rank) do
        {:ok, s} -> {:cont, {:ok, acc ++ [s]}}
        {:error, e} -> {:halt, {:error, e}}
      end
    end)
  end

  @doc "A free TCP port on the loopback interface (for the DP rendezvous)."
  @spec free_port() :: :inet.port_number()
  def free_port do
    {:ok, socket} = :gen_tcp.listen(0, ip: {127, 0, 0, 1})
    {:ok, port} = :inet.port(socket)
    :ok = :gen_tcp.close(socket)
    port
  end

  @doc """
  Runs `fun.(runtime_opts)` for DP rank `rank`: `runtime_opts` are the `__runtime__`
  options of a generated binding (the rank's session, the `:ml_inference` timeout
  profile). Returns the value of `{:ok, value}`; an error is raised naming the rank and
  `what`.
  """
  @spec run!(
          t(),
          non_neg_integer(),
          String.t(),
          (keyword() -> {:ok, term()} | {:error, Error.t()})
        ) ::
          term()
  def run!(%__MODULE__{sessions: sessions}, rank, what, fun) do
    opts = [session_id: Enum.at(sessions, rank).id, timeout_profile: :ml_inference]

    case fun.(opts) do
      {:ok, value} ->
        value

      {:error, %Error{} = e} ->
        raise %{e | message: "DP rank #{rank}: #{what} failed: #{e.message}"}
    end
  end

  @doc """
  Makes rank `rank`'s model runner (`create_runner` with `runner_opts`) and loads the
  weights saved at `weights_path` into it; raises as `run!/4` does.
  """
  @spec load_runner!(t(), non_neg_integer(), String.t(), keyword()) :: term()
  def load_runner!(ranks, rank, weights_path, runner_opts) do
    run!(ranks, rank, "create_runner", &Runner.create_runner([{:__runtime__, &1} | runner_opts]))
    run!(ranks, rank, "load_model", &Runner.load_model(weights_path, __runtime__: &1))
  end

  @doc """
  Runs `fun.(rank)` for every rank at once (one task each) and returns the results by
  rank; raises if one of them raises.
  """
  @spec both(t(), (non_neg_integer() -> result)) :: [result] when result: term()
  def both(%__MODULE__{size: size}, fun) do
    0..(size - 1)
    |> Enum.map(fn rank -> Task.async(fn -> fun.(rank) end) end)
    |> Task.await_many(@call_timeout_ms)
  end

  @doc """
  Closes the sessions and stops the pools (every Python process exits), and the peer
  node if one was started.
  """
  @spec stop(t()) :: :ok
  def stop(%__MODULE__{pool: pool, sessions: sessions, peer: peer}) do
    for s <- sessions, do: Session.close(s)

    _ = VllmBridge.stop_pool(pool)

    if peer do
      _ = Nodes.stop_pool(peer.node, pool)
      Nodes.stop_peer(peer)
    end

    :ok
  end
end
