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
  # The callback runs in the worker's process: one that raises, throws or exits is caught
  # and logged (once per worker start), and the start goes on without calling it again.

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

  defp callback(%{callback: callback, meta: meta} = p, info) do
    if first_start?(meta) do
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
    else
      p
    end
  end

  # Only while start_pool waits for the pool's first start (a worker outside a pool: its
  # own start).
  defp first_start?(%{started: started}) when started != nil,
    do: :atomics.get(started, 1) == 0

  defp first_start?(_), do: true
end
