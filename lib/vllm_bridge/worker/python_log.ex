defmodule VllmBridge.Worker.PythonLog do
  @moduledoc false
  # The `log` frames of a worker (docs/PROTOCOL.md): Python logging records of level
  # warning and above, forwarded to `Logger` with the Python logger's name as a prefix and
  # as the `python_logger` metadata (`vllm_worker` names the worker).

  require Logger

  @doc "Logs one `log` frame of the worker `label`; a malformed one is logged as such."
  @spec emit(binary(), String.t()) :: :ok
  def emit(bin, label) do
    case VllmBridge.Codec.decode(bin) do
      {:ok, ["log", level, name, message]} ->
        Logger.log(
          level(level),
          fn -> "[python #{name}] #{message}" end,
          vllm_worker: label,
          python_logger: name
        )

      other ->
        Logger.warning("vllm_bridge worker #{label}: malformed log frame #{inspect(other)}")
    end

    :ok
  end

  defp level("debug"), do: :debug
  defp level("info"), do: :info
  defp level("warning"), do: :warning
  defp level(_), do: :error
end
