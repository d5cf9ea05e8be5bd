defmodule VllmBridge.Worker.PythonLog do
  @moduledoc false
  # The `log` frames of a worker (docs/PROTOCOL.md): Python logging records at or above
  # the pool's `log_level`, forwarded to `Logger` with the Python logger's name as a
  # prefix, and the metadata `vllm_pool`, `vllm_worker` (the index; nil outside a pool),
  # `os_pid` and `python_logger`.

  require Logger

  @doc "Logs one `log` frame of the worker whose state is `state`; a malformed one is logged as such."
  @spec emit(binary(), map()) :: :ok
  def emit(bin, state) do
    label = VllmBridge.Worker.label(state)

    case VllmBridge.Codec.decode(bin) do
      {:ok, ["log", level, name, message]} ->
        Logger.log(
          level(level),
          fn -> "[python #{name}] #{message}" end,
          [{:python_logger, name} | VllmBridge.Worker.LogMeta.of(state)]
        )

      other ->
        Logger.warning(
          "vllm_bridge worker #{label}: malformed log frame #{inspect(other)}",
          VllmBridge.Worker.LogMeta.of(state)
        )
    end

    :ok
  end

  defp level("debug"), do: :debug
  defp level("info"), do: :info
  defp level("warning"), do: :warning
  defp level(_), do: :error
end
