defmodule VllmBridge.Telemetry do
  @moduledoc """
  Telemetry events of vllm_bridge, in the `:telemetry` conventions.

  The library cannot depend on hex packages, so it calls `:telemetry` only when the host
  application has it loaded: an app that depends on `:telemetry` receives ordinary events
  (`:telemetry.attach/4` works as usual), and one that does not pays one BIF call per
  event.

  The table of events is filled in by the modules that emit them.
  """

  # The host app may not have :telemetry at all; the call below is guarded at run time.
  @compile {:no_warn_undefined, :telemetry}

  @doc """
  Emits `event` with `measurements` and `metadata` when `:telemetry` is loaded, and does
  nothing otherwise.

      iex> VllmBridge.Telemetry.execute([:vllm_bridge, :example], %{count: 1}, %{})
      :ok
  """
  @spec execute([atom()], map(), map()) :: :ok
  def execute(event, measurements, metadata) do
    # `:telemetry` is loaded once anything attached a handler (attaching calls into it);
    # before that no handler could receive the event, so skipping it loses nothing.
    if :erlang.function_exported(:telemetry, :execute, 3) do
      :telemetry.execute(event, measurements, metadata)
    end

    :ok
  end

  @doc "Whether `:telemetry` is loaded, i.e. whether an event could reach a handler."
  @spec enabled?() :: boolean()
  def enabled?, do: :erlang.function_exported(:telemetry, :execute, 3)
end
