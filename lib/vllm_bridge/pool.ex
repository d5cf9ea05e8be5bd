defmodule VllmBridge.Pool do
  @moduledoc """
  Named pools of Python workers.

  Pools come from the application config, started with the application:

      # config/runtime.exs
      config :vllm_bridge,
        pools: [
          default: [size: 2],
          ranks: [size: 4, worker_env: {MyApp.Ranks, :env, []}]
        ]

  (default: none; `MyApp.Ranks.env(index)` returns `[{"VLLM_DP_RANK", "\#{index}"}]`: a
  `config.exs` of a release holds data, never a function: `mix release` refuses it;
  docs/USING.md), or are started and stopped at run time with `start/2` and `stop/1`
  (`VllmBridge.start_pool/2`, `VllmBridge.stop_pool/1`). Options: `VllmBridge.Pool.Options`.

  A call picks its pool with the runtime option `pool_name:` (default: `:default`, or
  `config :vllm_bridge, runtime: [pool_name: ...]`). Inside a pool a call goes to the
  least loaded worker with room (at most `max_in_flight` calls pipelined per worker);
  when every worker is full it waits in the pool's bounded queue, and past `queue_size`
  waiters it gets `{:error, %VllmBridge.Error{type: :queue_full}}`. The choice is made in
  the caller's process with atomics: no pool process sits on
  the path of a call unless it has to queue.

  A worker whose Python process dies is restarted by the pool's supervisor; until its new
  process has done its handshake (and its `on_start`, which runs again) the worker takes
  no calls, and then its full capacity is back. Stopping a pool (or the application)
  closes every worker's port; a Python process that does not exit on EOF within `shutdown_grace` is killed. If the BEAM itself
  dies, each Python process sees EOF (and its parent gone) and exits.
  """

  alias VllmBridge.{Error, Worker}
  alias VllmBridge.Worker.Progress
  alias VllmBridge.Pool.{Directory, Options, Slots}

  @typedoc "A pool's name (any term; usually an atom)."
  @type name :: term()

  @doc """
  Starts pool `name` under the application's supervisor and waits until every worker has
  done its handshake and its `on_start`. A pool of that name must not be running.

  The workers start at once, side by side; each has `start_timeout` for its handshake and
  `start_timeout` more for its `on_start`, and enforces them itself (a start past either
  fails naming the stage). This function waits for those outcomes: it never gives up
  before a worker's own limits do (only a worker that stops answering altogether, past
  both limits and a margin, is reported as stuck, naming its index and stage).

  When a worker cannot start, the pool is stopped and the first failure (in worker index
  order) is returned, naming the worker: a Python process that ended before its
  handshake with the last lines of its stderr, an `on_start` that raised with its Python
  type, message and traceback. Each failure is logged once; a worker is not restarted
  while this function waits.
  """
  @spec start(name(), keyword()) :: {:ok, pid()} | {:error, Error.t()}
  def start(name, opts \\ []) do
    with :ok <- Directory.app_started(),
         {:ok, opts} <- Options.validate(opts) do
      # The :progress callback runs in a process of its own, which the workers tell of
      # their stages: however slow it is, no worker waits for it (VllmBridge.Worker.Progress).
      {opts, runner} = Progress.start_runner(name, opts)
      spec = {VllmBridge.Pool.Supervisor, {name, opts}}

      case DynamicSupervisor.start_child(VllmBridge.PoolSupervisor, spec) do
        {:ok, sup} ->
          deadline = System.monotonic_time(:millisecond) + start_budget(opts)
          result = await_workers(name, sup, deadline, opts[:start_timeout])
          # Every stage reported so far reaches the callback before this returns, unless
          # the callback is still busy at the start's own deadline.
          Progress.finish_runner(runner, name, deadline)
          result

        {:error, {:already_started, _}} ->
          Progress.finish_runner(runner, name, System.monotonic_time(:millisecond))
          {:error, Error.new(:bad_argument, "pool #{inspect(name)} is already started")}

        {:error, reason} ->
          Progress.finish_runner(runner, name, System.monotonic_time(:millisecond))
          {:error, start_error(name, reason)}
      end
    end
  end

  # Past the workers' own limits, a margin for the work around them (reading a dead
  # process's stderr, killing it): the workers' timers were armed before this deadline
  # was set (each worker's init ran inside start_child), so they always fire first.
  @start_margin 5_000

  # The longest a worker's start may take by its own rules: the handshake, then on_start.
  defp start_budget(opts) do
    stages = if opts[:on_start], do: 2, else: 1
    stages * opts[:start_timeout] + @start_margin
  end

  # One deadline for all the workers (they start side by side, so waiting for each in
  # turn with its own full budget would let the total grow with the pool's size).
  defp await_workers(name, sup, deadline, start_timeout) do
    failed =
      case workers_of(sup) do
        {:ok, workers} ->
          Enum.find_value(workers, fn {i, pid} ->
            # At least a moment: a worker that is ready answers at once, and must not be
            # reported as not answering because this process was scheduled late.
            remaining = max(deadline - System.monotonic_time(:millisecond), 100)

            case Worker.await_ready(pid, remaining) do
              {:ok, _hello} ->
                nil

              # The backstop: the worker itself did not answer (its own timers never
              # fired): named, with the stage it was in.
              {:error, %Error{type: :timeout, details: %{stage: _}} = e} ->
                %{
                  e
                  | message:
                      "worker #{i}: #{e.message}, and its own limit (start_timeout, " <>
                        "#{start_timeout} ms a stage) did not end it: it is not answering"
                }

              {:error, e} ->
                e
            end
          end)

        :stopped ->
          nil
      end

    cond do
      # stop/1 (from another process) ended the pool while it started: the supervisor's
      # own life says so, whatever its workers' exits looked like.
      not Process.alive?(sup) ->
        {:error,
         Error.new(
           :worker_exit,
           "pool #{inspect(name)} did not start: it was stopped while starting"
         )}

      failed ->
        stop(name)
        {:error, %{failed | message: "pool #{inspect(name)} did not start: #{failed.message}"}}

      true ->
        # From now on a worker whose start fails is restarted by the pool's supervisor;
        # until now it waited for this function to stop the pool (VllmBridge.Worker.Starting).
        with {:ok, %{started: started}} when started != nil <- Directory.pool(name),
             do: :atomics.put(started, 1, 1)

        {:ok, sup}
    end
  end

  defp workers_of(sup) do
    workers =
      for {{Worker, i}, pid, _, _} <- Supervisor.which_children(sup), is_pid(pid) do
        {i, pid}
      end

    {:ok, Enum.sort(workers)}
  catch
    # The pool's supervisor is gone or going: stop/1 ran meanwhile.
    :exit, _ -> :stopped
  end

  defp start_error(name, {:shutdown, {:failed_to_start_child, _id, reason}}),
    do: start_error(name, reason)

  defp start_error(name, {:shutdown, {:start_failed, %Error{} = e}}),
    do: %{e | message: "pool #{inspect(name)} did not start: #{e.message}"}

  defp start_error(name, reason),
    do: Error.new(:worker_exit, "pool #{inspect(name)} did not start: #{inspect(reason)}")

  @doc "Stops pool `name` and every Python process of it."
  @spec stop(name()) :: :ok | {:error, Error.t()}
  def stop(name) do
    case Directory.started?() and Registry.lookup(VllmBridge.Pool.Names, name) do
      [{sup, _}] ->
        _ = DynamicSupervisor.terminate_child(VllmBridge.PoolSupervisor, sup)
        :ok

      _none ->
        {:error, not_started(name)}
    end
  end

  @doc "The names of the pools that are running on this node."
  @spec names() :: [name()]
  def names, do: Directory.pools()

  @doc """
  The nodes where a pool named `name` runs, this one included, sorted: those a call with
  `pool_name: name` may go to (this node first when it is among them; `node:` picks
  another). Found through the `:pg` scope `VllmBridge.Pool.Groups`, which each node's
  application starts and each pool joins: a pool leaves it when it stops, and a node's
  pools when that node disconnects. Only the nodes connected to this one are seen (`:pg`'s
  view is not transitive), and a pool just started elsewhere is seen a moment later.
  `names/0`, `workers/1` and `status/2` are this node's; for another node's, ask it
  (`:erpc.call(node, VllmBridge.Pool, :status, [name])`).

      VllmBridge.Pool.nodes(:gpu)   #=> [:"app@host-a", :"gpu@host-b"]
  """
  @spec nodes(name()) :: [node()]
  def nodes(name), do: VllmBridge.Remote.nodes(name)

  @doc """
  The workers of pool `name`, by index: pid, OS pid and instance of those serving, `nil`
  for one that is starting. For diagnostics and tests (a DP rank's OS process, say).
  """
  @spec workers(name()) ::
          {:ok,
           [
             %{
               index: non_neg_integer(),
               pid: pid(),
               os_pid: integer(),
               instance: String.t(),
               load: integer()
             }
             | nil
           ]}
          | {:error, Error.t()}
  def workers(name) do
    with {:ok, meta} <- meta(name) do
      {:ok,
       for i <- 0..(meta.size - 1) do
         case Directory.worker(name, i) do
           {pid, instance} ->
             os_pid =
               try do
                 Worker.os_pid(pid)
               catch
                 :exit, _ -> nil
               end

             %{index: i, pid: pid, os_pid: os_pid, instance: instance, load: Slots.load(meta, i)}

           nil ->
             nil
         end
       end}
    end
  end

  @doc """
  The status of pool `name` now: `{:ok, %VllmBridge.Pool.Status{}}` with, per worker, its
  index, OS pid, device, state (`:starting`, `:ready`, `:running`), the running request's
  target and age, its queue, the sessions and references it holds, its restarts, RSS and
  CUDA memory (see `VllmBridge.Pool.Status` for every field and where it comes from).

  It never waits behind a running request: each worker's Python process answers from its
  reader thread. `opts`: `:timeout` (ms, default 1 000) for each worker's answer; a figure
  not had in time is `nil`. The workers are asked side by side.
  """
  @spec status(name(), keyword()) :: {:ok, VllmBridge.Pool.Status.t()} | {:error, Error.t()}
  def status(name, opts \\ []) do
    case Keyword.get(opts, :timeout, 1_000) do
      # (At most what `receive ... after` takes: a larger one would raise there.)
      t when is_integer(t) and t >= 0 and t <= 4_294_967_295 ->
        with {:ok, meta} <- meta(name), do: {:ok, VllmBridge.Pool.Status.collect(meta, t)}

      t ->
        {:error,
         Error.new(
           :bad_argument,
           "status timeout must be a non-negative integer (ms) of at most 4294967295, " <>
             "got #{inspect(t)}"
         )}
    end
  end

  @doc """
  Waits up to `timeout` ms (`:infinity`: without a bound) until every worker of pool
  `name` serves again. Any other timeout is a `:bad_argument` error naming it.
  """
  @spec await_ready(name(), timeout()) :: :ok | {:error, Error.t()}
  def await_ready(name, timeout \\ 30_000)

  def await_ready(name, timeout)
      when timeout == :infinity or (is_integer(timeout) and timeout >= 0) do
    deadline = if timeout == :infinity, do: :infinity, else: now_ms() + timeout

    Stream.repeatedly(fn ->
      case workers(name) do
        {:ok, ws} -> Enum.all?(ws, & &1)
        # No application: nothing will start the pool (one not started yet may be).
        {:error, e} -> if Directory.started?(), do: false, else: {:error, e}
      end
    end)
    |> Enum.find_value(fn
      true ->
        :ok

      {:error, e} ->
        {:error, e}

      false ->
        if deadline != :infinity and now_ms() > deadline do
          {:error, Error.new(:timeout, "pool #{inspect(name)} not ready within #{timeout} ms")}
        else
          Process.sleep(20)
          nil
        end
    end)
  end

  def await_ready(_name, timeout),
    do:
      {:error,
       Error.new(
         :bad_argument,
         "await_ready timeout must be a non-negative integer (ms) or :infinity, " <>
           "got #{inspect(timeout)}"
       )}

  defp now_ms, do: System.monotonic_time(:millisecond)

  @doc false
  @spec meta(name()) :: {:ok, VllmBridge.Pool.Meta.t()} | {:error, Error.t()}
  def meta(name) do
    case Directory.pool(name) do
      {:ok, meta} -> {:ok, meta}
      :error -> {:error, not_started(name)}
    end
  end

  @doc false
  # The error of a request for pool `name`, which is not started (or the application is not).
  @spec not_started(name()) :: Error.t()
  def not_started(name) do
    Directory.not_started(fn ->
      Error.new(
        :bad_argument,
        "pool #{inspect(name)} is not started (running: #{inspect(Directory.pools())})"
      )
    end)
  end
end
