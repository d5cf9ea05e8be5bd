# A stand-in for the `:telemetry` library (a hex package this machine cannot fetch), for
# the tests of VllmBridge.Telemetry's events: the part of its API the tests use,
# `attach/4`, `attach_many/4`, `detach/1`, `list_handlers/1` and `execute/3`, with its
# behaviour: handlers are kept in an ETS table keyed by event (an event costs one lookup)
# and called in the process that emits the event, and a handler that raises is detached.
#
# Loaded only by the tests that attach handlers (`VllmBridge.TelemetryHelpers.load!/0`):
# until then `:telemetry` is not loaded and the bridge takes its path without telemetry.
# Once loaded it stays for the rest of the run, and is harmless to the other tests: an
# event nobody attached to costs them one ETS lookup, as with the real library.
defmodule :telemetry do
  @moduledoc false

  @table :telemetry_stand_in_handlers

  @doc false
  def attach(id, event, fun, config), do: attach_many(id, [event], fun, config)

  @doc false
  def attach_many(id, events, fun, config) when is_function(fun, 4) do
    table()

    # One row per event of a handler, keyed by the event, as :telemetry keeps them: an
    # event is one lookup.
    if :ets.match(@table, {:_, id, :_, :_}) == [] do
      :ets.insert(@table, for(event <- events, do: {event, id, fun, config}))
      :ok
    else
      {:error, :already_exists}
    end
  end

  @doc false
  def detach(id) do
    table()

    if :ets.match(@table, {:_, id, :_, :_}) == [] do
      {:error, :not_found}
    else
      :ets.match_delete(@table, {:_, id, :_, :_})
      :ok
    end
  end

  @doc false
  def list_handlers(prefix) do
    table()

    for {event, id, _fun, _config} <- :ets.tab2list(@table),
        List.starts_with?(event, prefix),
        do: %{id: id, event_name: event}
  end

  @doc false
  def execute(event, measurements, metadata) when is_map(measurements) and is_map(metadata) do
    for {^event, id, fun, config} <- handlers(event) do
      try do
        fun.(event, measurements, metadata, config)
      catch
        class, reason ->
          # As :telemetry does: a failing handler is detached (and says so).
          :ets.match_delete(@table, {:_, id, :_, :_})

          IO.warn(
            "telemetry stand-in: handler #{inspect(id)} detached: #{inspect({class, reason})}"
          )
      end
    end

    :ok
  end

  # Nothing attached yet (no table): no handler.
  defp handlers(event) do
    :ets.lookup(@table, event)
  rescue
    ArgumentError -> []
  end

  # The table lives in a process of its own, so that it outlives the test that made it.
  defp table do
    if :ets.whereis(@table) == :undefined do
      parent = self()

      {pid, ref} =
        spawn_monitor(fn ->
          try do
            :ets.new(@table, [:bag, :public, :named_table, read_concurrency: true])
          rescue
            # Another process made it meanwhile.
            ArgumentError -> :ok
          end

          send(parent, {:telemetry_stand_in, self()})
          Process.sleep(:infinity)
        end)

      receive do
        {:telemetry_stand_in, ^pid} -> Process.demonitor(ref, [:flush])
        {:DOWN, ^ref, _, _, reason} -> raise "telemetry stand-in: #{inspect(reason)}"
      end
    end

    @table
  end
end
