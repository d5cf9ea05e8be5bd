defmodule VllmBridge.Demo.Ranks do
  @moduledoc """
  The demo's data-parallel ranks: a pool of Python workers, worker `i` being DP rank `i`,
  and one session pinned to each.

  Each worker gets its rank through its environment (`worker_env`): `VLLM_DP_RANK`,
  `VLLM_DP_SIZE`, `VLLM_DP_MASTER_IP`/`VLLM_DP_MASTER_PORT` (a free local port, where rank
  0 hosts the rendezvous), `VLLM_DP_BACKEND=gloo` (the DP collectives go through the CPU:
  two NCCL ranks cannot share one GPU, and the step's agreement runs on the CPU anyway),
  `VLLM_LOG_BATCHSIZE_INTERVAL` (batch-size tracking on) and `OMP_NUM_THREADS=1` (two
  ranks share the machine's cores; torch's thread pool would otherwise oversubscribe
  them).

  Calls go through the generated bindings (`run!/4` hands them the rank's session and the
  `:ml_inference` timeout profile). `both/2` runs one function per rank concurrently (one
  task per rank): the DP collectives need every rank inside the same call at once.
  """

  alias VllmBridge.{Error, Session}
  alias Vllm.Demo.Rank.Module, as: Runner

  @enforce_keys [:pool, :sessions, :size, :master_port]
  defstruct [:pool, :sessions, :size, :master_port]

  @typedoc "The pool name, one session per rank (by rank), the DP size and master port."
  @type t :: %__MODULE__{
          pool: atom(),
          sessions: [Session.t()],
          size: pos_integer(),
          master_port: :inet.port_number()
        }

  @call_timeout_ms 600_000

  @doc """
  Starts pool `pool` of `size` workers as DP ranks and opens a session on each. While the
  workers start (importing torch takes seconds), `progress` is called with lines to show:
  each rank as it is ready, and every 2 s the ranks still starting, from the pool's own
  `:progress` reports (`VllmBridge.Pool.Options`).
  """
  @spec start(atom(), pos_integer(), (String.t() -> any())) :: {:ok, t()} | {:error, Error.t()}
  def start(pool, size, progress) do
    port = free_port()

    with {:ok, _} <- VllmBridge.start_pool(pool, pool_opts(size, port, progress)),
         {:ok, sessions} <- open_sessions(pool, size) do
      {:ok, %__MODULE__{pool: pool, sessions: sessions, size: size, master_port: port}}
    end
  end

  defp pool_opts(size, port, progress) do
    [
      size: size,
      progress: &report(&1, progress),
      worker_env: fn rank ->
        [
          {"VLLM_DP_RANK", rank},
          {"VLLM_DP_SIZE", size},
          {"VLLM_DP_MASTER_IP", "127.0.0.1"},
          {"VLLM_DP_MASTER_PORT", port},
          {"VLLM_DP_BACKEND", "gloo"},
          {"VLLM_LOG_BATCHSIZE_INTERVAL", 3600},
          {"OMP_NUM_THREADS", 1}
        ]
      end
    ]
  end

  @doc false
  # One worker's start report (called in that worker's process): a line for a rank that
  # is ready, and one per rank every 2 s while it imports or runs its on_start.
  @spec report(map(), (String.t() -> any())) :: any()
  def report(%{stage: :ready} = info, progress) do
    progress.(
      "  [#{secs(info.elapsed_ms)}] rank #{info.index} ready: os pid #{info.os_pid}, " <>
        "device #{info.device}"
    )
  end

  def report(%{stage: :waiting} = info, progress) do
    doing = if info.waiting_for == :handshake, do: "importing", else: "running its on_start"
    progress.("  [#{secs(info.elapsed_ms)}] rank #{info.index} still starting (#{doing})")
  end

  def report(_info, _progress), do: :ok

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

  @doc "Closes the sessions and stops the pool (every Python process exits)."
  @spec stop(t()) :: :ok
  def stop(%__MODULE__{pool: pool, sessions: sessions}) do
    Enum.each(sessions, &Session.close/1)
    _ = VllmBridge.stop_pool(pool)
    :ok
  end
end
