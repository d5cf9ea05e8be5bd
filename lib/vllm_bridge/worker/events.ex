defmodule VllmBridge.Worker.Events do
  @moduledoc false
  # The telemetry events of a worker process's life (VllmBridge.Telemetry documents
  # them): `[:vllm_bridge, :worker, :start]` once it is ready, and at its end exactly
  # one of `:exit` (its Python process went down or never started: not asked for) and
  # `:stop` (it was stopped: its pool stopped, `Worker.close/1`). Each is built only when
  # `:telemetry` is loaded.
  #
  # `state` is the worker's (VllmBridge.Worker.Starting.init/1): `started_at` (monotonic,
  # native: when its port was opened), `handshake_time` (native, once the hello came),
  # `restarts` (how many processes ran at its index of its pool before it).

  alias VllmBridge.Telemetry

  @doc "The worker is ready (its hello came and its on_start, if any, returned)."
  @spec started(map()) :: :ok
  def started(state) do
    if Telemetry.enabled?() do
      Telemetry.execute(
        [:vllm_bridge, :worker, :start],
        %{
          system_time: System.system_time(),
          duration: System.monotonic_time() - state.started_at,
          handshake_time: state.handshake_time
        },
        Map.put(metadata(state), :device, device(state))
      )
    end

    :ok
  end

  @doc """
  The worker's Python process went down, or its start failed: `why` says how; `in_flight`
  is how many requests it took with it (each of them answered `:worker_exit`).
  """
  @spec exited(map(), String.t() | term(), non_neg_integer()) :: :ok
  def exited(state, why, in_flight) do
    if Telemetry.enabled?() do
      Telemetry.execute(
        [:vllm_bridge, :worker, :exit],
        %{
          system_time: System.system_time(),
          duration: System.monotonic_time() - state.started_at,
          in_flight: in_flight
        },
        metadata(state) |> Map.put(:reason, why) |> Map.put(:phase, phase(state))
      )
    end

    :ok
  end

  @doc "The worker process was stopped (`reason`, its exit reason)."
  @spec stopped(map(), term()) :: :ok
  def stopped(state, reason) do
    if Telemetry.enabled?() do
      Telemetry.execute(
        [:vllm_bridge, :worker, :stop],
        %{
          system_time: System.system_time(),
          duration: System.monotonic_time() - state.started_at
        },
        metadata(state) |> Map.put(:reason, reason) |> Map.put(:phase, phase(state))
      )
    end

    :ok
  end

  @doc """
  The event of the end of a worker process that stops with `reason` (its `terminate/2`),
  unless it was told already: a Python process that went down or a start that failed is
  an `:exit` told when it happened; a stop asked for is a `:stop`; a crash of the worker
  process itself an `:exit` (`in_flight` requests lost).
  """
  @spec ended(map(), term(), non_neg_integer()) :: :ok
  def ended(_state, {:shutdown, {kind, _}}, _in_flight)
      when kind in [:worker_exit, :start_failed],
      do: :ok

  def ended(%{phase: :failed}, _reason, _in_flight), do: :ok

  def ended(state, reason, _in_flight) when reason in [:normal, :shutdown],
    do: stopped(state, reason)

  def ended(state, {:shutdown, _} = reason, _in_flight), do: stopped(state, reason)
  def ended(state, reason, in_flight), do: exited(state, Exception.format_exit(reason), in_flight)

  defp metadata(state) do
    %{
      pool: state.pool,
      index: state.index,
      os_pid: state.os_pid,
      instance: state.instance,
      restarts: state.restarts
    }
  end

  defp device(%{hello: %{"device" => device}}), do: device
  defp device(_state), do: nil

  defp phase(%{phase: :ready}), do: :ready
  defp phase(_state), do: :starting
end
