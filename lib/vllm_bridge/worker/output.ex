defmodule VllmBridge.Worker.Output do
  @moduledoc false
  # A worker's stdout and stderr, line by line into Logger (docs/PROTOCOL.md, "Output").
  #
  # The Python process's fds 1 and 2 are two private FIFOs, each read by a `cat` port that
  # this process owns (one process per worker, beside it, linked). Why the reading end is
  # outside the Python process (not a thread in it): the last lines a process writes before
  # it dies (a C extension's abort message, faulthandler's traceback) are the ones that
  # matter, and a reader thread dies with them unread (measured: a line written just before
  # `os._exit` was lost 198 times in 200 with an in-process reader thread, 0 times with a
  # FIFO read by another process; bench/results/telemetry-and-status.md, "Status and logs").
  # Whatever writes to the fds is covered the same way: print, `os.write(1, ...)`, C code,
  # child processes that inherit them. And a flood of output never touches the worker
  # process's mailbox, where replies pass.
  #
  # Each line goes to Logger (stdout at :info, stderr at :warning) with the metadata
  # `vllm_pool`, `vllm_worker` (the index), `os_pid` and `python_stream`, cut as
  # VllmBridge.Worker.OutputLines says. When Logger cannot keep up and more than
  # @max_backlog chunks wait here, chunks are dropped, counted, and the count is logged
  # once the backlog is gone: memory stays bounded. The
  # partial last line is logged when its stream ends. When the worker process goes, this
  # one waits up to @drain_ms for both streams to end (the Python process and its children
  # gone), then kills the readers and stops; and kills what is left of the worker's
  # processes (VllmBridge.Worker.OsProcess, told by `procs/2`): a worker process killed
  # (no terminate/2, so no close) or stopped before its close was done leaves a Python
  # process that ignores the EOF of its port (stuck in C code) running, else.

  use GenServer

  require Logger

  alias VllmBridge.Worker.{OsProcess, OutputLines}

  # One reader: a shell that makes its FIFO ($1) (so that no name exists before
  # something that removes it), starts a reader that opens it (which waits for a writer:
  # this process's hold, opened once the shell says "M"), says "R" once it has it open
  # (the name may go from then on) and then is `cat` on it; and a watcher, whose read of
  # the port (the shell's stdin, fd 4 here) returns only when the port closes or the BEAM
  # is gone (killed, halted, at any point of this): it removes the names and kills the
  # reader, even one blocked in its open. When `cat` ends first, the shell exits with its
  # status (0: its FIFO ended) after it kills the watcher and removes the names itself.
  # $2, when not empty, is the worker's start-up stderr file (Launcher.stderr_file/0),
  # which a BEAM that died during the start never deletes. Both ends remove the FIFO's
  # name before the file (the launch script checks the names after it made the file),
  # and the shell's `rm` always runs: a halting BEAM may end `cat` first (its hold was the
  # only writer), and `kill $w` then stop the watcher between its `read` and its `rm`
  # (test/runtime/output_reader_test.exs). The file is of no use once `cat` ended: the
  # holds go only after the hello (the file deleted) or once the worker process is gone
  # (a failed start read the file's tail first). Nothing of it writes to the BEAM's
  # stderr (a `cat` that loses its port would print "write error: Broken pipe").
  @reader ~S"""
  exec 2>/dev/null 4<&0
  mkfifo -m 600 -- "$1" || exit 1
  (exec 4<&- 3<"$1" && printf R && exec cat <&3) &
  c=$!
  (read _ <&4; rm -f -- "$1" ${2:+"$2"}; kill $c) &
  w=$!
  printf M
  wait $c
  s=$?
  kill $w
  rm -f -- "$1" ${2:+"$2"}
  exit $s
  """
  # How long the readers have to make their FIFOs.
  @made_ms 30_000
  @max_backlog 512
  @drain_ms 2_000

  @doc """
  Starts the readers of two FIFOs (they make them), linked to the caller (the worker
  process): `{:ok, pid, {stdout_fifo, stderr_fifo}}`. `meta`: `:pool`, `:index`, and
  `:stderr_file` (the start-up stderr file or nil: the readers delete it as they end).
  """
  @spec start_link(keyword()) :: {:ok, pid(), {String.t(), String.t()}} | {:error, term()}
  def start_link(meta) do
    base = fifo_base()
    fifos = {base <> "-out", base <> "-err"}

    # Unlinked, then linked by init/1: a gen_server parent's exit would stop it at once,
    # its mailbox (the last lines) unread; a linked worker's exit is drained.
    case GenServer.start(__MODULE__, {fifos, Keyword.put(meta, :worker, self())}) do
      {:ok, pid} -> {:ok, pid, fifos}
      {:error, reason} -> {:error, reason}
    end
  end

  @doc "Tells the reader the Python process's OS pid (metadata of every line after)."
  @spec os_pid(pid(), non_neg_integer() | nil) :: :ok
  def os_pid(pid, os_pid), do: GenServer.cast(pid, {:os_pid, os_pid})

  @doc "Tells the reader the worker's OS processes, those killed if left when it goes."
  @spec procs(pid(), OsProcess.t()) :: :ok
  def procs(pid, procs), do: GenServer.cast(pid, {:procs, procs})

  @doc """
  The Python process has opened its FIFOs (its hello came): their names go (nothing is
  left in the temporary folder), and so do this process's own holds on them, once both
  readers have opened them too.
  """
  @spec unlink(pid()) :: :ok
  def unlink(pid), do: GenServer.cast(pid, :unlink)

  @doc "The longest line logged as it is (bytes); a longer one is cut."
  @spec max_line() :: pos_integer()
  defdelegate max_line, to: OutputLines

  defp fifo_base do
    name = "vllm_bridge-out-#{System.pid()}-#{Base.url_encode64(:rand.bytes(12), padding: false)}"

    Path.join(System.tmp_dir!(), name)
  end

  # -- server ------------------------------------------------------------------------------

  @impl true
  def init({{out, err} = fifos, meta}) do
    Process.flag(:trap_exit, true)

    streams =
      for {name, path} <- [stdout: out, stderr: err], into: %{} do
        # :use_stdio: the reader's stdout is this port, and so is its stdin, which is its
        # lifeline (@reader): nothing is ever written to it, so it ends only when the port
        # closes or the BEAM dies, and then the reader goes too.
        port = open_reader(path, meta[:stderr_file])

        {port, %{name: name, buf: "", skip: false, opened: false}}
      end

    with :ok <- await_made(streams, fifos) do
      # Each FIFO held open read-write here until the Python process has opened it and so
      # has its reader: a reader's open waits for a writer, so it never waits for ever (a
      # launch that failed). Read-write never waits, and takes nothing: nothing reads it.
      holds = for path <- [out, err], do: hold(path)
      true = Process.link(meta[:worker])

      {:ok,
       %{
         worker: meta[:worker],
         holds: holds,
         fifos: fifos,
         # Whether the Python process has opened its FIFOs (its hello came).
         hello: false,
         streams: streams,
         meta: VllmBridge.Worker.LogMeta.new(meta[:pool], meta[:index], nil),
         dropped: 0,
         draining: false,
         # Looks at the group's members alone, once the known processes were gone.
         member_looks: 0,
         procs: %OsProcess{}
       }}
    else
      {:error, reason} ->
        unlink_fifos(fifos)
        for {port, _} <- streams, do: close(port)
        {:stop, reason}
    end
  end

  @doc false
  # A reader's port (@reader) on FIFO `path`, deleting `stderr_file` (or nil) at its end.
  @spec open_reader(String.t(), String.t() | nil) :: port()
  def open_reader(path, stderr_file) do
    sh = System.find_executable("sh") || "/bin/sh"

    Port.open({:spawn_executable, sh}, [
      {:args, ["-c", @reader, "vllm_bridge-output-reader", path, stderr_file || ""]},
      :binary,
      :stream,
      :exit_status,
      :use_stdio
    ])
  end

  # Each reader's "M": its FIFO exists.
  defp await_made(streams, fifos) do
    deadline = System.monotonic_time(:millisecond) + @made_ms

    Enum.reduce_while(streams, :ok, fn {port, stream}, :ok ->
      left = max(deadline - System.monotonic_time(:millisecond), 0)

      receive do
        {^port, {:data, "M"}} ->
          {:cont, :ok}

        {^port, {:exit_status, status}} ->
          {:halt,
           {:error,
            "the output reader of #{fifo(fifos, stream.name)} could not make " <>
              "it (mkfifo failed, status #{status})"}}
      after
        left ->
          {:halt,
           {:error,
            "the output reader of #{fifo(fifos, stream.name)} did not make it " <>
              "within #{@made_ms} ms"}}
      end
    end)
  end

  defp fifo({out, _err}, :stdout), do: out
  defp fifo({_out, err}, :stderr), do: err

  defp close(port) do
    Port.close(port)
  rescue
    ArgumentError -> :ok
  end

  @impl true
  def handle_cast({:os_pid, os_pid}, state),
    do: {:noreply, %{state | meta: Keyword.put(state.meta, :os_pid, os_pid)}}

  def handle_cast({:procs, procs}, state), do: {:noreply, %{state | procs: procs}}

  def handle_cast(:unlink, state), do: {:noreply, maybe_unlink(%{state | hello: true})}

  @impl true
  # The reader's first byte: it has its FIFO open.
  def handle_info({port, {:data, <<"R", data::binary>>}}, %{streams: streams} = state)
      when is_map_key(streams, port) and not :erlang.map_get(port, streams).opened do
    state = %{state | streams: Map.update!(streams, port, &%{&1 | opened: true})}
    state = maybe_unlink(state)
    if data == "", do: {:noreply, state}, else: handle_info({port, {:data, data}}, state)
  end

  def handle_info({port, {:data, data}}, %{streams: streams} = state)
      when is_map_key(streams, port) do
    {:message_queue_len, backlog} = Process.info(self(), :message_queue_len)

    if backlog > @max_backlog do
      {:noreply, %{state | dropped: state.dropped + byte_size(data)}}
    else
      state = report_dropped(state)
      stream = OutputLines.feed(streams[port], data, state.meta)
      {:noreply, %{state | streams: Map.put(streams, port, stream)}}
    end
  end

  def handle_info({port, {:exit_status, status}}, %{streams: streams} = state)
      when is_map_key(streams, port) do
    stream = streams[port]
    OutputLines.flush(stream, state.meta)
    state = %{state | streams: Map.delete(streams, port)}

    cond do
      state.draining and state.streams == %{} ->
        settle(state)

      # A reader that ends at its FIFO's end exits 0; one that did not (killed, say)
      # leaves the Python process writing into a FIFO nobody reads, which fails from
      # now on (a broken pipe): the worker goes (it is linked) and starts again.
      status != 0 and not state.draining ->
        {:stop, {:reader_gone, stream.name, status}, state}

      true ->
        {:noreply, state}
    end
  end

  # The worker process is gone: what its Python process (and its children) wrote last
  # still comes; then this process goes.
  # Its holds go: a Python process that never opened its FIFOs (it died before its
  # hello) leaves no writer, and its readers see their ends at once. Streams that ended
  # already (a process that closed its output) are no sign that its processes are gone:
  # they too get @drain_ms, then terminate/2 kills what is left of them.
  def handle_info({:EXIT, worker, _reason}, %{worker: worker, draining: false} = state) do
    state = %{release(state) | draining: true}
    Process.send_after(self(), :drained, @drain_ms)
    if state.streams == %{}, do: settle(state), else: {:noreply, state}
  end

  def handle_info(:drained, state), do: {:stop, :normal, state}
  def handle_info(:settle, state), do: settle(state)
  def handle_info(_other, state), do: {:noreply, state}

  # Both streams have ended: the Python process closed its output as it exited, but
  # its exit, and that of its sentinel (vllm_bridge/bridge/worker/sentinel.py, which
  # exits once its parent has), take a few more milliseconds. Looked at again every
  # @settle_ms: the interpreter (which may have closed its output and stayed) within
  # the @drain_ms that ends it anyway; once it is gone, the members of its group
  # (the sentinel, or a child left over) for @member_looks looks. Then terminate/2
  # kills what is left, and says so.
  @settle_ms 50
  @member_looks 5
  defp settle(state) do
    known_gone = OsProcess.known_gone?(state.procs)

    if known_gone and (state.member_looks >= @member_looks or OsProcess.gone?(state.procs)) do
      {:stop, :normal, state}
    else
      Process.send_after(self(), :settle, @settle_ms)
      looks = if known_gone, do: state.member_looks + 1, else: state.member_looks
      {:noreply, %{state | member_looks: looks}}
    end
  end

  @impl true
  def terminate(_reason, state) do
    # The names first: once its readers are gone, nothing of this worker is left.
    unlink_fifos(state.fifos)
    state = state |> release() |> report_dropped()

    for {port, stream} <- state.streams do
      OutputLines.flush(stream, state.meta)

      # Closing the port ends the reader's lifeline: one still blocked opening its FIFO,
      # or whose FIFO a child process that outlives the worker keeps open, is killed.
      close(port)
    end

    # The worker process is gone (the port closed with it): a process of it still there
    # has had @drain_ms to go, or closed its output and stayed.
    # (remaining/1 once: with the interpreter gone, each look scans /proc.)
    left = if state.draining, do: OsProcess.remaining(state.procs), else: []

    if left != [] do
      Logger.warning(
        "vllm_bridge: processes of the Python worker (os pid " <>
          "#{OsProcess.label(state.procs)}) are still there after its worker process " <>
          "ended (#{OsProcess.pids_text(left)}); killing them",
        state.meta
      )

      OsProcess.kill_worker(state.procs)
    end

    :ok
  end

  defp hold(path) do
    {:ok, io} = :file.open(path, [:read, :write, :raw, :binary])
    io
  end

  # Once the Python process (its hello) and both readers have opened the FIFOs, their
  # names go (nothing is left in the temporary folder), and so do the holds. Not before: a
  # reader that had not opened its FIFO yet would find no name, or no writer.
  defp maybe_unlink(%{hello: true} = state) do
    if Enum.all?(state.streams, fn {_port, stream} -> stream.opened end) do
      unlink_fifos(state.fifos)
      release(state)
    else
      state
    end
  end

  defp maybe_unlink(state), do: state

  # From now on each reader sees the end of its FIFO when the Python process (and the
  # children that inherited its fds) have closed it.
  defp release(state) do
    Enum.each(state.holds, &:file.close/1)
    %{state | holds: []}
  end

  defp unlink_fifos({out, err}) do
    _ = File.rm(out)
    _ = File.rm(err)
    :ok
  end

  defp report_dropped(%{dropped: 0} = state), do: state

  defp report_dropped(state) do
    Logger.warning(
      "vllm_bridge worker output: #{state.dropped} bytes of output dropped (Logger could " <>
        "not keep up with it)",
      state.meta
    )

    %{state | dropped: 0}
  end
end
