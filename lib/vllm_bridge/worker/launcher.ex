defmodule VllmBridge.Worker.Launcher do
  @moduledoc false
  # Starting and ending one Python worker OS process: the port (`{:spawn_executable,
  # python}`, `-m vllm_bridge.bridge.worker [--allow M ...] [--also-allow M ...]
  # [--max-refs N] [--poll-us N]
  # --max-frame-bytes N`, `:stream`, `:binary`, `:nouse_stdio`, `:exit_status`; frames are
  # cut by `VllmBridge.Worker.Framer`), and making sure the processes are gone (EOF first,
  # `kill -9` if one lingers: VllmBridge.Worker.OsProcess knows them and kills only
  # them). The handshake is the worker process's first state
  # (VllmBridge.Worker.Starting, checked by VllmBridge.Worker.Hello).

  require Logger

  alias VllmBridge.Error
  alias VllmBridge.Worker.OsProcess

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
  `VllmBridge.Pool.Options.default_python/0`; see `VllmBridge.Pool.Options.resolve_python/1`), `:worker_module` (default `"vllm_bridge.bridge.worker"`), `:allow` (module
  allow-list, `--allow`, `[]` for the worker's default), `:modules` (added to that list,
  `--also-allow`), `:max_refs` (`--max-refs`), `:poll_us` (`--poll-us`: how
  long the worker polls for the next request before it sleeps; 0, the default, sleeps at
  once), `:max_frame_bytes` (`--max-frame-bytes`, default `default_max_frame_bytes/0`),
  `:log_level` (`--log-level`, default `:warning`), `:env` (`[{name, value}]`),
  `:output` (`{stdout_fifo, stderr_fifo}` from `VllmBridge.Worker.Output`, or nil: the
  BEAM's own), `:stderr_file` (with `:output`: a path from `stderr_file/0`, or nil: the
  Python process writes its stderr there until it takes its stderr FIFO back after its
  handshake; see "Start-up stderr" in docs/PROTOCOL.md).
  """
  @spec open(keyword()) :: {:ok, port()} | {:error, Error.t()}
  def open(opts) do
    python = VllmBridge.Pool.Options.resolve_python(opts[:python])

    cond do
      not is_binary(python) ->
        {:error, Error.new(:bad_argument, "python must be a path, got #{inspect(python)}")}

      not String.contains?(python, "/") ->
        {:error,
         Error.new(:bad_argument, "python #{inspect(python)} is not a command found on PATH")}

      not File.regular?(python) ->
        {:error, Error.new(:bad_argument, "python executable #{inspect(python)} does not exist")}

      true ->
        args =
          ["-m", Keyword.get(opts, :worker_module, "vllm_bridge.bridge.worker")] ++
            Enum.flat_map(Keyword.get(opts, :allow, []), &["--allow", &1]) ++
            Enum.flat_map(Keyword.get(opts, :modules, []), &["--also-allow", &1]) ++
            max_refs_args(Keyword.get(opts, :max_refs)) ++
            poll_args(Keyword.get(opts, :poll_us, 0)) ++
            log_level_args(Keyword.get(opts, :log_level, :warning)) ++
            ["--max-frame-bytes", Integer.to_string(max_frame_bytes(opts))]

        # The node's slot directory (VllmBridge.Shm) first: a pool's own env cannot name it.
        env =
          for {k, v} <- VllmBridge.Shm.worker_env() ++ beam_env() ++ Keyword.get(opts, :env, []),
              do: {to_charlist(k), to_charlist(v)}

        {exe, args, env} =
          case Keyword.get(opts, :output) do
            nil -> {python, args, env}
            fifos -> output_command(fifos, Keyword.get(opts, :stderr_file), python, args, env)
          end

        {:ok, open_port(exe, args, env)}
    end
  end

  @doc false
  # The port of a worker: `exe args` with `env` (charlist pairs), its requests on fd 3 and
  # its replies on fd 4. Apart from open/1 so that a test of the launch script opens its
  # port exactly as a worker's is opened.
  @spec open_port(String.t(), [String.t()], [{charlist(), charlist()}]) :: port()
  def open_port(exe, args, env) do
    # :stream, not {:packet, 4}: the port's own framing would allocate whatever
    # length a header declares (see VllmBridge.Worker.Framer).
    Port.open({:spawn_executable, exe}, [
      {:args, args},
      {:env, env},
      :stream,
      :binary,
      :nouse_stdio,
      :exit_status
    ])
  end

  # Output and start-up stderr. The Python process is exec'd by a tiny /bin/sh script
  # that points fd 1 at the stdout FIFO and fd 2 at the stderr FIFO
  # (VllmBridge.Worker.Output reads both, and logs what comes line by line), and, when
  # the start-up stderr is captured, keeps the stderr FIFO on fd 5 and points fd 2 at a
  # new private file meanwhile (created under umask 077, refusing one that exists; the
  # umask is put back before the exec). The exec keeps the pid, so the port's os_pid is
  # the Python process's, and no process is left behind. Fds 3 and 4 (the port's pipes)
  # are not touched. After its handshake the worker puts fd 5 back on fd 2, copies what
  # the file holds there (vllm_bridge.bridge.worker.stderr), and the worker process
  # deletes the file; when the start fails, the file's tail goes into the error
  # (`stderr_tail/1`) and the file is deleted. A BEAM that dies deletes nothing: the
  # output readers delete the file as they end (VllmBridge.Worker.Output), each after its
  # FIFO's name; so the script, once it made the file, checks that both names are still
  # there (the Elixir side deletes them only after the hello), and else deletes the file
  # and exits: a reader that ended before the file was made has removed a name by then.
  # Nothing the worker writes reaches the BEAM's own stdout or stderr.
  @stderr_fd 5
  #
  # The FIFOs are opened so that no moment of a BEAM's death can wedge the script or leave
  # a file behind (the readers delete the names and go when the BEAM dies, whenever that
  # is; VllmBridge.Worker.Output). A plain `1>"$o"` would create a regular file at a name
  # already deleted, and would wait for ever in open() on a FIFO whose reader is gone. So
  # each path must be a FIFO (`-p`), and is opened read-write first (fds 6 and 7): on
  # Linux that never waits, whether a reader is there or not. It may still have created
  # a regular file, if the name went between the test and the open: the fd says so, and
  # the script deletes what it made and exits. Then fds 1 and 5 (or 2) are the same FIFOs
  # opened again write-only through /proc/self/fd (no wait: fds 6 and 7 are readers) and
  # fds 6 and 7 are closed: the Python process must not be a reader of its own output,
  # or with its reader gone a full pipe would block its writes for ever instead of
  # failing (EPIPE), and it could never notice that its port closed.
  @open_fifos ~S"""
  o=$1 e=$2 && shift 2 || exit 1
  [ -p "$o" ] && [ -p "$e" ] || exit 1
  exec 6<>"$o"
  [ -p /proc/self/fd/6 ] || { rm -f -- "$o"; exit 1; }
  exec 7<>"$e"
  [ -p /proc/self/fd/7 ] || { rm -f -- "$e"; exit 1; }
  """
  @capture_script @open_fifos <>
                    ~S'exec 1>/proc/self/fd/6 5>/proc/self/fd/7 6<&- 7<&- && u=$(umask) && umask 077 && set -C && exec 2>"$VLLM_BRIDGE_STDERR_FILE" && umask "$u" && { [ -p "$o" ] && [ -p "$e" ] || { rm -f -- "$VLLM_BRIDGE_STDERR_FILE"; exit 1; }; } && exec "$@"'
  @output_script @open_fifos <>
                   ~S'exec 1>/proc/self/fd/6 2>/proc/self/fd/7 6<&- 7<&- && exec "$@"'
  @own_env ["VLLM_BRIDGE_STDERR_FILE", "VLLM_BRIDGE_STDERR_FD", "VLLM_BRIDGE_BEAM"] ++
             VllmBridge.Shm.own_env()

  # This BEAM names itself (os pid and start time) to the worker's sentinel
  # (vllm_bridge.bridge.worker.sentinel), which kills the worker's process group once
  # this BEAM is gone: after a kill -9 nobody here is left to end what the worker's
  # code started in its group. Not as pid 1 (a container's init): the kernel ends every
  # process of the namespace with it.
  defp beam_env do
    case OsProcess.ident(String.to_integer(System.pid())) do
      {pid, start} when pid > 1 -> [{"VLLM_BRIDGE_BEAM", "#{pid}:#{start}"}]
      _ -> []
    end
  end

  @doc "The environment variables the launcher sets itself (a pool's `worker_env` may not)."
  @spec own_env() :: [String.t()]
  def own_env, do: @own_env

  @doc false
  # The executable, arguments and environment that run `python args` with its output on
  # the FIFOs `{out, err}` and its start-up stderr captured in `file` (nil: not captured),
  # also for tests of the script itself.
  @spec output_command(
          {String.t(), String.t()},
          String.t() | nil,
          String.t(),
          [String.t()],
          [{charlist(), charlist()}]
        ) :: {String.t(), [String.t()], [{charlist(), charlist()}]}
  def output_command({out, err}, nil, python, args, env) do
    {"/bin/sh", ["-c", @output_script, "vllm_bridge worker", out, err, python | args], env}
  end

  def output_command({out, err}, file, python, args, env) do
    # The launcher's own pairs last: a port's env takes the last value of a name, and these
    # must be the script's, whatever a caller's env says (a pool refuses them earlier).
    env =
      env ++
        [
          {~c"VLLM_BRIDGE_STDERR_FILE", to_charlist(file)},
          {~c"VLLM_BRIDGE_STDERR_FD", ~c"#{@stderr_fd}"}
        ]

    {"/bin/sh", ["-c", @capture_script, "vllm_bridge worker", out, err, python | args], env}
  end

  @doc """
  A fresh path for a worker's start-up stderr (`open/1`'s `:stderr_file`): in the system's
  temporary folder, named unguessably; the file itself is made by the launch script.
  """
  @spec stderr_file() :: String.t()
  def stderr_file do
    name =
      "vllm_bridge-stderr-#{System.pid()}-#{Base.url_encode64(:rand.bytes(12), padding: false)}"

    Path.join(System.tmp_dir!(), name)
  end

  # Lines of a start's stderr put in its error (all of them go to `details.stderr`, up to
  # @tail_bytes): the last few say why (a traceback's last line is its exception).
  @tail_bytes 16_384
  @tail_lines 40

  @doc """
  The last lines (at most #{@tail_lines}, from the last #{@tail_bytes} bytes) of a start-up
  stderr file, then the file deleted; `nil` for no file (or nothing in it).
  """
  @spec stderr_tail(String.t() | nil) :: String.t() | nil
  def stderr_tail(nil), do: nil

  def stderr_tail(file) do
    text =
      case File.open(file, [:read, :binary]) do
        {:ok, io} ->
          size = File.stat!(file).size
          {:ok, _} = :file.position(io, max(size - @tail_bytes, 0))
          data = IO.binread(io, @tail_bytes)
          File.close(io)
          if is_binary(data), do: data, else: ""

        {:error, _} ->
          ""
      end

    delete_stderr(file)

    text
    |> String.split(["\r\n", "\n"])
    |> Enum.map(&String.trim_trailing/1)
    |> Enum.reject(&(&1 == ""))
    |> Enum.take(-@tail_lines)
    |> case do
      [] -> nil
      lines -> Enum.join(lines, "\n")
    end
  end

  @doc "Deletes a start-up stderr file (nil, or one already gone: nothing to do)."
  @spec delete_stderr(String.t() | nil) :: :ok
  def delete_stderr(nil), do: :ok

  def delete_stderr(file) do
    _ = File.rm(file)
    :ok
  end

  @doc "The frame limit of `opts` (`:max_frame_bytes`, else the default)."
  @spec max_frame_bytes(keyword()) :: pos_integer()
  def max_frame_bytes(opts), do: Keyword.get(opts, :max_frame_bytes) || @max_frame_bytes

  defp max_refs_args(nil), do: []
  defp max_refs_args(n), do: ["--max-refs", Integer.to_string(n)]

  defp log_level_args(:warning), do: []
  defp log_level_args(level), do: ["--log-level", Atom.to_string(level)]

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
  Closes the port (the worker sees EOF and exits) and waits up to `grace` ms for the
  worker's processes (`VllmBridge.Worker.OsProcess`: the port's, the one its hello
  named, and the members of its process group started since) to be gone; kills them
  with SIGKILL if one is still there (`VllmBridge.Worker.OsProcess.kill_worker/1`,
  which also reaches the child of a `python:` wrapper that forked it and exited).
  Returns `:exited` when they left by themselves, `:killed` when they had to be killed
  (logged as a warning); either way once they are gone (`kill/1`).
  """
  @spec close(port(), OsProcess.t(), non_neg_integer()) :: :exited | :killed
  def close(port, %OsProcess{} = procs, grace) do
    try do
      Port.close(port)
    rescue
      ArgumentError -> :ok
    end

    if OsProcess.await_gone(procs, grace) do
      :exited
    else
      Logger.warning(
        "vllm_bridge: the Python worker (os pid #{OsProcess.label(procs)}) did not exit " <>
          "within #{grace} ms of its port closing (its processes still there: " <>
          "#{OsProcess.pids_text(OsProcess.remaining(procs))}); killing them"
      )

      kill(procs)
      :killed
    end
  end

  # A process killed with SIGKILL is still there while the kernel frees its memory
  # (3 ms for 64 MiB written, 48 ms for 1 GiB, longer on a loaded machine): a stop that
  # returned at the signal left the interpreter behind for whoever looks next.
  @reap_ms 1_500

  @doc "The longest `kill/1` waits for the processes it killed to be gone (ms)."
  @spec reap_ms() :: pos_integer()
  def reap_ms, do: @reap_ms

  @doc """
  Kills a worker's processes (`VllmBridge.Worker.OsProcess.kill_worker/1`) and returns
  once they are gone, or after #{@reap_ms} ms (`reap_ms/0`, counted in the worker's
  shutdown, `VllmBridge.Worker.child_spec/1`) with a warning naming those still there
  (one in an uninterruptible wait, a driver call, ends only when that returns).
  """
  @spec kill(OsProcess.t()) :: :ok
  def kill(%OsProcess{} = procs) do
    OsProcess.kill_worker(procs)

    unless OsProcess.await_gone(procs, @reap_ms) do
      Logger.warning(
        "vllm_bridge: processes of the Python worker (os pid #{OsProcess.label(procs)}) " <>
          "are still there #{@reap_ms} ms after SIGKILL " <>
          "(#{OsProcess.pids_text(OsProcess.remaining(procs))})"
      )
    end

    :ok
  end
end
