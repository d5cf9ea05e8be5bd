defmodule VllmBridge.Worker.Progress do
  @moduledoc false
  # A worker's start, stage by stage (VllmBridge.Worker.Starting reports them): the
  # telemetry event `[:vllm_bridge, :worker, :progress]` (measurements `elapsed`, native
  # units since the worker process began this start; metadata `pool`, `index`, `stage`,
  # `os_pid`, `device` once the handshake came, `error` for :failed), one Logger info line
  # when a worker of a pool is ready, and the pool's `:progress` callback, called with the
  # same metadata plus `elapsed_ms` while `VllmBridge.Pool.start/2` waits for the pool's
  # first start (not for a restart later).
  #
  # Stages: :launch (the Python process runs), :waiting (every @tick_ms while it has not
  # finished its handshake or on_start; `waiting_for` says which), :handshake (its hello
  # came: the allow-listed modules are imported), :on_start, :ready, :failed.
  #
  # The callback of a pool started by VllmBridge.Pool.start/2 runs in a process of its own
  # (start_runner/2, started by start/2's caller), not in the workers: each worker sends it
  # its stages ({:send, runner} in place of the callback), and a callback that is slow or
  # blocks delays no worker's start and no start_timeout. start/2 waits for it to have
  # handled what was sent before it returns, up to the start's own deadline; past that it
  # is killed and that is logged. A callback that raises, throws or exits is caught and
  # logged (once per worker), and is not called again for that worker; the start goes on.
  # (A callback given to a worker started outside a pool still runs in that worker.)

  require Logger

  alias VllmBridge.Telemetry

  @tick_ms 2_000

  @doc false
  @spec tick_ms() :: pos_integer()
  def tick_ms, do: @tick_ms

  @doc false
  @spec new(term(), non_neg_integer(), map() | nil, term()) :: map()
  def new(pool, index, meta, callback),
    do: %{pool: pool, index: index, meta: meta, callback: callback}

  @doc false
  # Reports stage `stage` of the start in `state` (the worker's), with `extra` metadata.
  @spec report(map(), atom(), map()) :: map()
  def report(state, stage, extra \\ %{}) do
    elapsed = System.monotonic_time() - state.started_at
    p = state.progress

    metadata =
      Map.merge(
        %{
          pool: p.pool,
          index: p.index,
          stage: stage,
          os_pid: state.os_pid,
          device: state.hello && state.hello["device"]
        },
        extra
      )

    Telemetry.execute([:vllm_bridge, :worker, :progress], %{elapsed: elapsed}, metadata)
    ms = System.convert_time_unit(elapsed, :native, :millisecond)

    if stage == :ready and p.meta do
      Logger.info(
        "vllm_bridge pool #{inspect(p.pool)}: worker #{p.index} ready in " <>
          "#{:erlang.float_to_binary(ms / 1000, decimals: 1)} s (os pid #{state.os_pid}, " <>
          "device #{metadata.device})",
        VllmBridge.Worker.LogMeta.new(p.pool, p.index, state.os_pid)
      )
    end

    %{state | progress: callback(p, Map.put(metadata, :elapsed_ms, ms))}
  end

  defp callback(%{callback: nil} = p, _info), do: p

  defp callback(%{callback: {:send, runner}, meta: meta} = p, info) do
    if first_start?(meta), do: send(runner, {:vllm_bridge_progress, info})
    p
  end

  defp callback(%{meta: meta} = p, info) do
    if first_start?(meta), do: apply_callback(p, info), else: p
  end

  defp apply_callback(%{callback: callback} = p, info) do
    try do
      case callback do
        {m, f, a} -> apply(m, f, [info | a])
        fun -> fun.(info)
      end

      p
    catch
      kind, reason ->
        Logger.warning(
          "vllm_bridge pool #{inspect(p.pool)}: the progress callback failed on worker " <>
            "#{p.index}'s #{info.stage} stage (it is not called again for this worker; " <>
            "the start goes on): " <> Exception.format(kind, reason, __STACKTRACE__),
          VllmBridge.Worker.LogMeta.new(p.pool, p.index, nil)
        )

        %{p | callback: nil}
    end
  end

  @doc false
  # The process that calls pool `pool`'s `callback` (nil: none) with the stages its
  # workers send, in the order they come; {opts with the callback replaced by
  # {:send, runner}, runner}.
  @spec start_runner(term(), keyword()) :: {keyword(), pid() | nil}
  def start_runner(pool, opts) do
    case opts[:progress] do
      nil ->
        {opts, nil}

      callback ->
        runner = spawn(fn -> run(pool, callback, MapSet.new()) end)
        {Keyword.put(opts, :progress, {:send, runner}), runner}
    end
  end

  @doc false
  # The start is over (the pool started or not): the runner handles what it was sent, then
  # ends. Waits for that until `deadline` (monotonic, ms); a runner still busy then (its
  # callback blocks) is killed, and that is logged.
  @spec finish_runner(pid() | nil, term(), integer()) :: :ok
  def finish_runner(nil, _pool, _deadline), do: :ok

  def finish_runner(runner, pool, deadline) do
    ref = Process.monitor(runner)
    send(runner, :done)

    receive do
      {:DOWN, ^ref, :process, _, _} -> :ok
    after
      max(deadline - System.monotonic_time(:millisecond), 0) ->
        Process.exit(runner, :kill)
        Process.demonitor(ref, [:flush])

        Logger.warning(
          "vllm_bridge pool #{inspect(pool)}: the progress callback was still running at " <>
            "the start's deadline; it was stopped (the stages after it were not delivered)",
          vllm_pool: pool
        )
    end
  end

  defp run(pool, callback, off) do
    receive do
      {:vllm_bridge_progress, info} -> run(pool, callback, call(pool, callback, info, off))
      :done -> drain(pool, callback, off)
    end
  end

  defp drain(pool, callback, off) do
    receive do
      {:vllm_bridge_progress, info} -> drain(pool, callback, call(pool, callback, info, off))
    after
      0 -> :ok
    end
  end

  # One stage to the callback, unless it failed for this worker before; `off`: the
  # indices it failed for.
  defp call(pool, callback, info, off) do
    if MapSet.member?(off, info.index) do
      off
    else
      case apply_callback(%{pool: pool, index: info.index, callback: callback}, info) do
        %{callback: nil} -> MapSet.put(off, info.index)
        _ -> off
      end
    end
  end

  # Only while start_pool waits for the pool's first start (a worker outside a pool: its
  # own start).
  defp first_start?(%{started: started}) when started != nil,
    do: :atomics.get(started, 1) == 0

  defp first_start?(_), do: true
end
