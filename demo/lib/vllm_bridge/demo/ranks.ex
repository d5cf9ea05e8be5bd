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

  alias VllmBridge.{Error, Pool, Session}
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
  workers start (importing torch takes seconds), `progress` is called with lines to show
  (a worker that is ready, and a heartbeat every 2 s).
  """
  @spec start(atom(), pos_integer(), (String.t() -> any())) :: {:ok, t()} | {:error, Error.t()}
  def start(pool, size, progress) do
    port = free_port()
    started = System.monotonic_time(:millisecond)
    task = Task.async(fn -> VllmBridge.start_pool(pool, pool_opts(size, port)) end)

    with {:ok, _} <- await_start(task, {pool, size, started, progress}, MapSet.new(), 2_000),
         {:ok, sessions} <- open_sessions(pool, size) do
      {:ok, %__MODULE__{pool: pool, sessions: sessions, size: size, master_port: port}}
    end
  end

  defp pool_opts(size, port) do
    [
      size: size,
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

  # Polls the starting pool every 250 ms: reports each rank as it becomes ready, and
  # who is still starting every 2 s (`beat` is when the next heartbeat is due, in ms).
  defp await_start(task, {pool, size, started, progress} = how, seen, beat) do
    case Task.yield(task, 250) do
      {:ok, result} ->
        report_ready(pool, started, seen, progress)
        result

      nil ->
        seen = report_ready(pool, started, seen, progress)
        elapsed = System.monotonic_time(:millisecond) - started

        if elapsed >= beat do
          waiting = for i <- 0..(size - 1), i not in seen, do: "rank #{i}"
          progress.("  [#{secs(elapsed)}] still starting: #{Enum.join(waiting, ", ")}")
        end

        await_start(task, how, seen, if(elapsed >= beat, do: beat + 2_000, else: beat))
    end
  end

  # Prints each worker that has become ready since the last look; returns who has.
  defp report_ready(pool, started, seen, progress) do
    case Pool.workers(pool) do
      {:ok, workers} ->
        Enum.reduce(workers, seen, fn
          %{index: i, os_pid: os_pid, pid: pid}, seen ->
            if i in seen do
              seen
            else
              device = VllmBridge.Worker.hello(pid)["device"]
              elapsed = System.monotonic_time(:millisecond) - started

              progress.(
                "  [#{secs(elapsed)}] rank #{i} ready: os pid #{os_pid}, device #{device}"
              )

              MapSet.put(seen, i)
            end

          nil, seen ->
            seen
        end)

      {:error, _} ->
        seen
    end
  end

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
