defmodule VllmBridge.Worker.Launcher do
  @moduledoc false
  # Starting and ending one Python worker OS process: the port (`{:spawn_executable,
  # python}`, `-m vllm_bridge.bridge.worker [--allow M ...] [--max-refs N] [--poll-us N]
  # --max-frame-bytes N`, `:stream`, `:binary`, `:nouse_stdio`, `:exit_status`; frames are
  # cut by `VllmBridge.Worker.Framer`), and making sure the process is gone (EOF first,
  # `kill -9` if it lingers). The handshake is the worker process's first state
  # (VllmBridge.Worker.Starting, checked by VllmBridge.Worker.Hello).

  require Logger

  alias VllmBridge.Error

  import Bitwise, only: [<<<: 2]

  # The frame limit, both ways, unless the pool says otherwise (`max_frame_bytes`); the
  # worker's own default (`--max-frame-bytes`) is the same.
  @max_frame_bytes 1 <<< 30
  @min_frame_bytes 64 <<< 10
  @packet_max 0xFFFF_FFFF

  @doc "The default frame limit (bytes), both ways."
  @spec default_max_frame_bytes() :: pos_integer()
  def default_max_frame_bytes, do: @max_frame_bytes

  @doc "The range a frame limit must lie in: the handshake and error replies must fit."
  @spec max_frame_range() :: Range.t()
  def max_frame_range, do: @min_frame_bytes..@packet_max

  @doc """
  Opens the port. Options: `:python` (the interpreter; default
  `VllmBridge.Pool.Options.default_python/0`), `:worker_module` (default `"vllm_bridge.bridge.worker"`), `:allow` (module
  allow-list, `[]` for the worker's default), `:modules` (added to that list,
  `--also-allow`), `:max_refs`, `:poll_us` (`--poll-us`: how
  long the worker polls for the next request before it sleeps; 0, the default, sleeps at
  once), `:max_frame_bytes` (`--max-frame-bytes`, default `default_max_frame_bytes/0`),
  `:env` (`[{name, value}]`).
  """
  @spec open(keyword()) :: {:ok, port()} | {:error, Error.t()}
  def open(opts) do
    python = Keyword.get_lazy(opts, :python, &VllmBridge.Pool.Options.default_python/0)

    cond do
      not is_binary(python) ->
        {:error, Error.new(:bad_argument, "python must be a path, got #{inspect(python)}")}

      not File.regular?(python) ->
        {:error, Error.new(:bad_argument, "python executable #{inspect(python)} does not exist")}

      true ->
        args =
          ["-m", Keyword.get(opts, :worker_module, "vllm_bridge.bridge.worker")] ++
            Enum.flat_map(Keyword.get(opts, :allow, []), &["--allow", &1]) ++
            Enum.flat_map(Keyword.get(opts, :modules, []), &["--also-allow", &1]) ++
            max_refs_args(Keyword.get(opts, :max_refs)) ++
            poll_args(Keyword.get(opts, :poll_us, 0)) ++
            ["--max-frame-bytes", Integer.to_string(max_frame_bytes(opts))]

        env = for {k, v} <- Keyword.get(opts, :env, []), do: {to_charlist(k), to_charlist(v)}

        # :stream, not {:packet, 4}: the port's own framing would allocate whatever
        # length a header declares (see VllmBridge.Worker.Framer).
        port =
          Port.open({:spawn_executable, python}, [
            {:args, args},
            {:env, env},
            :stream,
            :binary,
            :nouse_stdio,
            :exit_status
          ])

        {:ok, port}
    end
  end

  @doc "The frame limit of `opts` (`:max_frame_bytes`, else the default)."
  @spec max_frame_bytes(keyword()) :: pos_integer()
  def max_frame_bytes(opts), do: Keyword.get(opts, :max_frame_bytes) || @max_frame_bytes

  defp max_refs_args(nil), do: []
  defp max_refs_args(n), do: ["--max-refs", Integer.to_string(n)]

  defp poll_args(0), do: []
  defp poll_args(us), do: ["--poll-us", Integer.to_string(us)]

  @doc """
  What a worker process says when the Python process sends a frame header declaring
  `len` bytes, over the limit `max`.
  """
  @spec too_large_message(non_neg_integer() | nil, non_neg_integer(), pos_integer()) ::
          String.t()
  def too_large_message(os_pid, len, max) do
    "the Python worker (os pid #{os_pid}) sent a frame header declaring #{len} bytes, " <>
      "over the limit of #{max} bytes (max_frame_bytes); a length-prefixed stream cannot " <>
      "be trusted after that, so the worker is killed"
  end

  @doc "The OS pid behind a port (nil once it is closed)."
  @spec os_pid(port()) :: non_neg_integer() | nil
  def os_pid(port) do
    case Port.info(port, :os_pid) do
      {:os_pid, pid} -> pid
      _ -> nil
    end
  end

  @doc """
  Closes the port (the worker sees EOF and exits) and waits up to `grace` ms for the OS
  process to be gone; kills it with SIGKILL if it is still there. Returns `:exited` when
  the process left by itself, `:killed` when it had to be killed (logged as a warning).
  """
  @spec close(port(), non_neg_integer() | nil, non_neg_integer()) :: :exited | :killed
  def close(port, os_pid, grace) do
    try do
      Port.close(port)
    rescue
      ArgumentError -> :ok
    end

    if os_pid && not await_exit(os_pid, grace) do
      Logger.warning(
        "vllm_bridge: the Python worker (os pid #{os_pid}) did not exit within #{grace} ms " <>
          "of its port closing; killing it"
      )

      kill(os_pid)
      :killed
    else
      :exited
    end
  end

  @doc "Sends SIGKILL to an OS process."
  @spec kill(non_neg_integer()) :: :ok
  def kill(os_pid) when is_integer(os_pid) do
    System.cmd("kill", ["-KILL", Integer.to_string(os_pid)], stderr_to_stdout: true)
    :ok
  end

  @doc "Whether an OS process exists and is not a zombie (Linux `/proc`)."
  @spec alive?(non_neg_integer()) :: boolean()
  def alive?(os_pid) do
    case File.read("/proc/#{os_pid}/stat") do
      {:ok, stat} -> not (stat |> String.split(") ") |> List.last() |> String.starts_with?("Z"))
      {:error, _} -> false
    end
  end

  @doc "Waits up to `ms` for an OS process to be gone; true when it is."
  @spec await_exit(non_neg_integer(), non_neg_integer()) :: boolean()
  def await_exit(os_pid, ms) do
    cond do
      not alive?(os_pid) ->
        true

      ms <= 0 ->
        false

      true ->
        Process.sleep(min(ms, 10))
        await_exit(os_pid, ms - 10)
    end
  end
end
