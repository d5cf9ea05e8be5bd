defmodule VllmBridge.Worker.PythonLog do
  @moduledoc false
  # The `log` frames of a worker (docs/PROTOCOL.md): Python logging records at or above
  # the pool's `log_level`, forwarded to `Logger` with the Python logger's name as a
  # prefix, and the metadata `vllm_pool`, `vllm_worker` (the index; nil outside a pool),
  # `os_pid` and `python_logger`.

  require Logger

  alias VllmBridge.Codec
  alias VllmBridge.Codec.SlotExt
  alias VllmBridge.Worker.Describe

  @doc """
  Logs one `log` frame of the worker whose state is `state`. One whose level, logger
  name or message is not UTF-8 text, or that has other fields, is logged as malformed,
  described briefly (`VllmBridge.Worker.Describe`): the worker goes on.
  """
  @spec emit(binary(), map()) :: :ok
  def emit(bin, state) do
    # A log frame has no business naming result slots: any of this worker's it names are
    # handed back unread, so a forged one cannot make this process read slot data (whose
    # bound is a reply's, not a log record's); another worker's are left alone (the
    # decode fails, VllmBridge.Codec.SlotExt).
    decoded =
      SlotExt.unread(fn ->
        SlotExt.within_reply(state.origin, byte_size(bin), fn -> Codec.decode(bin) end)
      end)

    with {:ok, ["log", level, name, message]} <- decoded,
         level when is_binary(level) <- Describe.text(level),
         name when is_binary(name) <- Describe.text(name),
         true <- is_binary(Describe.text(message)) do
      Logger.log(
        level(level),
        fn -> "[python #{name}] #{message}" end,
        [{:python_logger, name} | VllmBridge.Worker.LogMeta.of(state)]
      )
    else
      _ ->
        Logger.warning(
          "vllm_bridge worker #{VllmBridge.Worker.label(state)}: malformed log frame " <>
            "(a log frame is [\"log\", level, name, message], each a string): " <>
            Describe.frame(decoded),
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
