defmodule VllmBridge.Worker.Launcher do
  @moduledoc """
  Starting and ending one Python worker OS process: the port (`{:spawn_executable,
  python}`, `-m vllm_bridge.worker [--allow M ...] [--max-refs N] [--poll-us N]
  --max-frame-bytes N`, `:stream`, `:binary`, `:nouse_stdio`, `:exit_status`; frames are
  cut by `VllmBridge.Worker.Framer`), the handshake with its version and frame-limit
  checks and start timeout, and making sure the process is gone (EOF first, `kill -9` if
  it lingers).
  """

  require Logger

  alias VllmBridge.{Codec, Error}
  alias VllmBridge.Worker.Framer

  import Bitwise, only: [<<<: 2]

  @protocol_version 1

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

  @doc "The protocol version this side speaks (docs/PROTOCOL.md)."
  @spec protocol_version() :: pos_integer()
  def protocol_version, do: @protocol_version

  @doc """
  Opens the port. Options: `:python` (the interpreter; default the `:vllm_bridge, :python`
  application env), `:worker_module` (default `"vllm_bridge.worker"`), `:allow` (module
  allow-list, `[]` for the worker's default), `:max_refs`, `:poll_us` (`--poll-us`: how
  long the worker polls for the next request before it sleeps; 0, the default, sleeps at
  once), `:max_frame_bytes` (`--max-frame-bytes`, default `default_max_frame_bytes/0`),
  `:env` (`[{name, value}]`).
  """
  @spec open(keyword()) :: {:ok, port()} | {:error, Error.t()}
  def open(opts) do
    python =
      Keyword.get_lazy(opts, :python, fn -> Application.fetch_env!(:vllm_bridge, :python) end)

    cond do
      not is_binary(python) ->
        {:error, Error.new(:bad_argument, "python must be a path, got #{inspect(python)}")}

      not File.regular?(python) ->
        {:error, Error.new(:bad_argument, "python executable #{inspect(python)} does not exist")}

      true ->
        args =
          ["-m", Keyword.get(opts, :worker_module, "vllm_bridge.worker")] ++
            Enum.flat_map(Keyword.get(opts, :allow, []), &["--allow", &1]) ++
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
  Waits up to `timeout` ms for the worker's `hello` and checks it: protocol version,
  pid, instance and frame limit. On failure the port is closed and the process killed.
  `opts` are those the port was opened with (`open/1`).
  """
  @spec handshake(port(), timeout(), keyword()) :: {:ok, map()} | {:error, Error.t()}
  def handshake(port, timeout, opts \\ []) do
    with {:ok, hello, _settled, _rest} <- handshake_settling(port, timeout, opts),
         do: {:ok, hello}
  end

  @doc """
  `handshake/3` for the worker process: meanwhile it answers the callers that give up
  (`{:"$vb_settle", id, alias}`, see `VllmBridge.Call.Request.give_up/2`) with `:cancelled`
  at once, and returns their ids, whose requests (still in its mailbox) it must drop;
  and what came after the hello: `{framer, frames}` (the framer's state, and whole
  frames read with the hello, to be handled as if they had arrived after it).
  """
  @spec handshake_settling(port(), timeout(), keyword()) ::
          {:ok, map(), MapSet.t(non_neg_integer()), {Framer.t(), [binary()]}}
          | {:error, Error.t()}
  def handshake_settling(port, timeout, opts \\ []) do
    os_pid = os_pid(port)
    deadline = System.monotonic_time(:millisecond) + timeout
    max = max_frame_bytes(opts)

    case await_hello(port, {os_pid, timeout, deadline, max}, Framer.new(), MapSet.new()) do
      {{:ok, hello}, settled, rest} ->
        case check_limit(hello, max) do
          :ok -> {:ok, hello, settled, rest}
          error -> failed(error, port, os_pid)
        end

      {other, _settled, _rest} ->
        failed(other, port, os_pid)
    end
  end

  defp await_hello(port, {os_pid, timeout, deadline, max} = how, framer, settled) do
    receive do
      {^port, {:data, data}} ->
        case Framer.feed(framer, data, max) do
          {:ok, [], framer} ->
            await_hello(port, how, framer, settled)

          {:ok, [hello | frames], framer} ->
            {check_hello(Codec.decode(hello)), settled, {framer, frames}}

          {:too_large, len, _frames} ->
            {{:error, Error.new(:protocol, too_large_message(os_pid, len, max))}, settled, nil}
        end

      {^port, {:exit_status, status}} ->
        {{:exited, status}, settled, nil}

      {:"$vb_settle", id, alias} ->
        send(alias, {alias, :cancelled, nil})
        await_hello(port, how, framer, MapSet.put(settled, id))
    after
      max(deadline - System.monotonic_time(:millisecond), 0) ->
        {{:error,
          Error.new(
            :worker_exit,
            "the Python worker (os pid #{os_pid}) sent no handshake within #{timeout} ms " <>
              "(start_timeout)"
          )}, settled, nil}
    end
  end

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

  defp failed(result, port, os_pid) do
    case result do
      {:exited, status} ->
        {:error,
         Error.new(
           :worker_exit,
           "the Python worker exited with status #{status} before its handshake " <>
             "(see its stderr above)"
         )}

      {:error, e} ->
        close(port, os_pid, 0)
        {:error, e}
    end
  end

  defp check_hello({:ok, ["hello", %{"protocol" => @protocol_version} = hello]}) do
    case hello do
      %{"import_errors" => failed} when is_map(failed) and map_size(failed) > 0 ->
        list = Enum.map_join(Enum.sort(failed), "; ", fn {m, why} -> "#{m} (#{why})" end)

        {:error,
         Error.new(
           :bad_argument,
           "the worker could not import allow-listed module(s): #{list}; " <>
             "fix the module or the pool's :allow option"
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
