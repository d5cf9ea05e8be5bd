defmodule VllmBridge.LogCollector do
  @moduledoc false
  # A `:logger` handler for tests: every event (message and metadata) is sent to the test
  # process that attached it, so a test can wait for a line logged by another process
  # (a worker's output reader) and look at its metadata, which captured text lacks.

  @doc "Attaches a handler sending `{:log, level, message, meta}` to the caller; returns its id."
  def attach do
    id = :"vb_log_collector_#{System.unique_integer([:positive])}"
    :ok = :logger.add_handler(id, __MODULE__, %{config: %{pid: self()}, level: :all})
    ExUnit.Callbacks.on_exit(fn -> :logger.remove_handler(id) end)
    id
  end

  @doc false
  def log(%{level: level, msg: msg, meta: meta}, %{config: %{pid: pid}}) do
    send(pid, {:log, level, text(msg, meta), meta})
  end

  defp text({:string, s}, _meta), do: IO.chardata_to_string(s)
  defp text({:report, r}, %{report_cb: cb}) when is_function(cb, 1), do: format(cb.(r))
  defp text({:report, r}, _meta), do: inspect(r)
  defp text({fmt, args}, _meta), do: format({fmt, args})

  defp format({fmt, args}), do: IO.chardata_to_string(:io_lib.format(fmt, args))
end
