defmodule VllmBridge.Worker.Hello do
  @moduledoc false
  # The worker's handshake, as VllmBridge.Worker checks it while it is starting: the
  # first frame must be a `hello` (docs/PROTOCOL.md) of this side's protocol version,
  # naming the Python process's pid and instance, with no allow-listed module that failed
  # to import, and announcing (if at all) the frame limit the worker was started with.
  # Also the errors of a start that ends before a hello: the Python process exited, it
  # sent nothing within `start_timeout`, or a frame header over the limit.

  alias VllmBridge.Codec
  alias VllmBridge.Error
  alias VllmBridge.Worker.{Describe, OsProcess}

  @protocol_version 1

  # A worker module of a user's may leave `stream_window` out of its hello: then the
  # window of our own worker (vllm_bridge.bridge.protocol.flow.STREAM_WINDOW).
  @default_stream_window 32

  @typedoc "What the worker announced in its handshake."
  @type t :: %{optional(String.t()) => term()}

  @doc "The stream window of a hello that announces none (our worker's)."
  @spec default_stream_window() :: pos_integer()
  def default_stream_window, do: @default_stream_window

  @doc "The protocol version this side speaks (docs/PROTOCOL.md)."
  @spec protocol_version() :: pos_integer()
  def protocol_version, do: @protocol_version

  @doc """
  Checks the first frame of a worker started with frame limit `max`: `{:ok, hello}` or
  the error that ends its start.
  """
  @spec check(binary(), pos_integer()) :: {:ok, t()} | {:error, Error.t()}
  def check(frame, max) do
    # (Slots a hello names are neither read nor handed back: no worker's pid is known
    # before its hello is checked, so the decode accepts none, VllmBridge.Codec.SlotExt,
    # and the start fails.)
    with {:ok, hello} <- check_hello(Codec.decode(frame)),
         :ok <- check_limit(hello, max),
         :ok <- check_window(hello),
         :ok <- check_shm(hello) do
      {:ok, hello}
    end
  end

  @doc """
  Checks the `pid` of a checked hello against `procs`, the processes of the worker's
  port (whose OS process is `os_pid`): it must be that process, one of its descendants
  or a process of its group started no earlier than the port, while the group is still
  the port's (the interpreter under a `python:` wrapper that forks it, also once the
  wrapper has exited; `VllmBridge.Worker.OsProcess.python/2`). The pid is
  this side's to kill; one that names any other process (`-1`, `0`, the BEAM's, another
  user's program) is refused, naming both. `{:ok, procs}` with the pid recorded.
  """
  @spec check_pid(t(), integer() | nil, OsProcess.t()) ::
          {:ok, OsProcess.t()} | {:error, Error.t()}
  def check_pid(%{"pid" => pid}, os_pid, procs) do
    case OsProcess.python(procs, pid) do
      {:ok, procs} ->
        {:ok, procs}

      :error ->
        {:error,
         Error.new(
           :protocol,
           "the worker's hello names os pid #{inspect(pid)}, which is neither its own " <>
             "process (os pid #{inspect(os_pid)}) nor one of that process's descendants " <>
             "or of its process group; refusing it"
         )}
    end
  end

  @doc """
  The chunks a stream of this worker may run ahead of its reader (docs/PROTOCOL.md,
  "Flow control"): the hello's `stream_window`, or our worker's when it has none.
  """
  @spec stream_window(t()) :: pos_integer()
  def stream_window(hello), do: Map.get(hello, "stream_window", @default_stream_window)

  @doc """
  The error of a Python process that exited with `status` before its hello; `stderr` the
  last lines it wrote there (`VllmBridge.Worker.Launcher.stderr_tail/1`), or nil.
  """
  @spec exited(integer(), String.t() | nil) :: Error.t()
  def exited(status, stderr) do
    with_stderr(
      :worker_exit,
      "the Python worker exited with status #{status} before its handshake",
      stderr
    )
  end

  @doc "The error of a Python process that sent no hello within `timeout` ms (`stderr` as above)."
  @spec timed_out(non_neg_integer() | nil, timeout(), String.t() | nil) :: Error.t()
  def timed_out(os_pid, timeout, stderr) do
    with_stderr(
      :worker_exit,
      "the Python worker (os pid #{os_pid}) sent no handshake within #{timeout} ms " <>
        "(start_timeout)",
      stderr
    )
  end

  # The last lines in the message (the last of them says why, a traceback's exception),
  # all of the tail in details.stderr.
  @message_lines 12

  defp with_stderr(type, text, nil),
    do: Error.new(type, text <> "; it wrote nothing to stderr", details: %{stderr: nil})

  defp with_stderr(type, text, stderr) do
    last = stderr |> String.split("\n") |> Enum.take(-@message_lines)

    Error.new(type, text <> "; the last lines of its stderr:\n    " <> Enum.join(last, "\n    "),
      details: %{stderr: stderr}
    )
  end

  # A worker that announces a frame limit must use the one it was given (a worker module
  # of a user's may announce none).
  defp check_limit(%{"max_frame_bytes" => n}, max) when n != max do
    {:error,
     Error.new(
       :protocol,
       "the worker announced max_frame_bytes #{inspect(n)}, but was started with #{max}"
     )}
  end

  defp check_limit(_hello, _max), do: :ok

  # A window the stream's reader could not give credit for (it sends room back each
  # time half of it has been read) would stall every stream.
  defp check_window(%{"stream_window" => n}) when not (is_integer(n) and n >= 2) do
    {:error,
     Error.new(
       :protocol,
       "the worker announced stream_window #{inspect(n)}; it must be an integer of at least 2"
     )}
  end

  defp check_window(_hello), do: :ok

  # A worker that opened a slot directory other than this node's (a python: wrapper that
  # changes VLLM_BRIDGE_SHM_DIR, another /dev/shm at the same path) would name result
  # slots this node cannot read. (One that opened none is fine: its tensors take the
  # pipe, VllmBridge.Shm.reads?/1.)
  defp check_shm(hello) do
    case VllmBridge.Shm.check_hello(hello) do
      :ok ->
        :ok

      {:other, what} ->
        {:error,
         Error.new(
           :bad_argument,
           "the worker opened the slot directory #{what}; start it with this node's " <>
             "VLLM_BRIDGE_SHM_DIR (a python: wrapper must pass the variable on)"
         )}
    end
  end

  defp check_hello({:ok, ["hello", %{"protocol" => @protocol_version} = hello]}) do
    case hello do
      %{"import_errors" => failed} when is_map(failed) and map_size(failed) > 0 ->
        list = import_errors(failed)

        {:error,
         Error.new(
           :bad_argument,
           "the worker could not import allow-listed module(s): #{list}; " <>
             "fix the module, or the pool's options: python_path: (where it is found), " <>
             "modules: or allow: (the allow-list)"
         )}

      %{"pid" => pid, "instance" => inst} when is_integer(pid) and is_binary(inst) ->
        {:ok, hello}

      _ ->
        {:error,
         Error.new(:protocol, "the worker's hello lacks pid or instance: #{inspect(hello)}")}
    end
  end

  defp check_hello({:ok, ["hello", %{"protocol" => other}]}) do
    {:error,
     Error.new(
       :protocol,
       "the worker speaks protocol version #{inspect(other)}, this side speaks " <>
         "#{@protocol_version}; refusing it"
     )}
  end

  defp check_hello({:ok, other}),
    do: {:error, Error.new(:protocol, "expected a hello, got #{inspect(other, limit: 8)}")}

  defp check_hello({:error, reason}),
    do: {:error, Error.new(:protocol, "undecodable handshake: #{reason}")}

  # The modules that failed to import and why, each a string from our worker; anything
  # else (a worker of one's own) described briefly. At most @shown_errors of them.
  @shown_errors 20
  defp import_errors(failed) do
    shown =
      failed
      |> Enum.take(@shown_errors)
      |> Enum.map(fn {m, why} -> "#{named(m)} (#{named(why)})" end)
      |> Enum.sort()

    more = map_size(failed) - length(shown)
    Enum.join(shown, "; ") <> if(more > 0, do: "; and #{more} more", else: "")
  end

  defp named(value), do: Describe.text(value) || Describe.item(value)
end
