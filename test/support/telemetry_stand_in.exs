# A stand-in for the `:telemetry` library (a hex package this machine cannot fetch), for
# the tests of VllmBridge.Telemetry's events: the part of its API the tests use,
# `attach/4`, `attach_many/4`, `detach/1`, `list_handlers/1` and `execute/3`, with its
# behaviour: handlers are kept in an ETS table and called in the process that emits the
# event, and a handler that raises is detached.
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

    if :ets.insert_new(@table, {id, events, fun, config}),
      do: :ok,
      else: {:error, :already_exists}
  end

  @doc false
  def detach(id) do
    table()

    case :ets.take(@table, id) do
      [_] -> :ok
      [] -> {:error, :not_found}
    end
  end

  @doc false
  def list_handlers(prefix) do
    table()

    for {id, events, _fun, _config} <- :ets.tab2list(@table),
        event <- events,
        List.starts_with?(event, prefix),
        do: %{id: id, event_name: event}
  end

  @doc false
  def execute(event, measurements, metadata) when is_map(measurements) and is_map(metadata) do
    for {id, events, fun, config} <- handlers(), event in events do
      try do
        fun.(event, measurements, metadata, config)
      catch
        class, reason ->
          # As :telemetry does: a failing handler is detached (and says so).
          :ets.delete(@table, id)

          IO.warn(
            "telemetry stand-in: handler #{inspect(id)} detached: #{inspect({class, reason})}"
          )
      end
    end

    :ok
  end

  # Nothing attached yet (no table): no handler.
  defp handlers do
    :ets.tab2list(@table)
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
            :ets.new(@table, [:set, :public, :named_table, read_concurrency: true])
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
