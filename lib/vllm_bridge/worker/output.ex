defmodule VllmBridge.Worker.Output do
  @moduledoc false
  # A worker's stdout and stderr, line by line into Logger (docs/PROTOCOL.md, "Output").
  #
  # The Python process's fds 1 and 2 are two private FIFOs, each read by a `cat` port that
  # this process owns (one process per worker, beside it, linked). Why the reading end is
  # outside the Python process (not a thread in it): the last lines a process writes
  # before it dies (a C extension's abort message, faulthandler's traceback) are the ones
  # that matter, and a reader thread dies with them unread (measured: a line written just
  # before `os._exit` was lost 198 times in 200 with an in-process reader thread, 0 times
  # with a FIFO read by another process; bench/README.md, "Worker output"). Whatever
  # writes to the fds is covered the same way: print, `os.write(1, ...)`, C code, child
  # processes that inherit them. And a flood of output never touches the worker process's
  # mailbox, where replies pass.
  #
  # Each line goes to Logger (stdout at :info, stderr at :warning) with the metadata
  # `vllm_pool`, `vllm_worker` (the index), `os_pid` and `python_stream`. A line is cut at
  # @max_line bytes (the rest of it up to its newline is dropped, and the line says so);
  # "\r" ends a line as "\n" does (progress bars), and empty lines are dropped. When
  # Logger cannot keep up and more than @max_backlog chunks wait here, chunks are dropped,
  # counted, and the count is logged once the backlog is gone: memory stays bounded. The
  # partial last line is logged when its stream ends. When the worker process goes, this
  # one waits up to @drain_ms for both streams to end (the Python process and its children
  # gone), then kills the readers and stops.

  use GenServer

  require Logger

  @max_line 16_384
  @max_backlog 512
  @drain_ms 2_000

  @doc """
  Makes the two FIFOs and starts their readers, linked to the caller (the worker
  process): `{:ok, pid, {stdout_fifo, stderr_fifo}}`. `meta`: `:pool`, `:index`.
  """
  @spec start_link(keyword()) :: {:ok, pid(), {String.t(), String.t()}} | {:error, term()}
  def start_link(meta) do
    base = fifo_base()
    fifos = {base <> "-out", base <> "-err"}

    case GenServer.start_link(__MODULE__, {fifos, Keyword.put(meta, :worker, self())}) do
      {:ok, pid} -> {:ok, pid, fifos}
      {:error, reason} -> {:error, reason}
    end
  end

  @doc "Tells the reader the Python process's OS pid (metadata of every line after)."
  @spec os_pid(pid(), non_neg_integer() | nil) :: :ok
  def os_pid(pid, os_pid), do: GenServer.cast(pid, {:os_pid, os_pid})

  @doc """
  The Python process has opened its FIFOs (its hello came): their names go (nothing is
  left in the temporary folder), and so do this process's own holds on them.
  """
  @spec unlink(pid()) :: :ok
  def unlink(pid), do: GenServer.cast(pid, :unlink)

  @doc "The longest line logged as it is (bytes); a longer one is cut."
  @spec max_line() :: pos_integer()
  def max_line, do: @max_line

  defp fifo_base do
    name = "vllm_bridge-out-#{System.pid()}-#{Base.url_encode64(:rand.bytes(12), padding: false)}"

    Path.join(System.tmp_dir!(), name)
  end

  # -- server ------------------------------------------------------------------------------

  @impl true
  def init({{out, err} = fifos, meta}) do
    Process.flag(:trap_exit, true)

    with :ok <- mkfifo(out),
         :ok <- mkfifo(err) do
      cat = System.find_executable("cat") || "/bin/cat"

      streams =
        for {name, path} <- [stdout: out, stderr: err], into: %{} do
          # :use_stdio: cat's stdout is this port. It opens the FIFO for reading, which
          # waits until the Python side opens it for writing.
          port =
            Port.open({:spawn_executable, cat}, [
              {:args, [path]},
              :binary,
              :stream,
              :exit_status,
              :use_stdio
            ])

          {port, %{name: name, buf: "", skip: false, os_pid: port_os_pid(port)}}
        end

      # Each FIFO held open read-write here until the Python process has opened it (its
      # hello): a reader's open waits for a writer, so without this a `cat` whose Python
      # process never opened its FIFO (a launch that failed, a BEAM that died meanwhile)
      # would wait for ever. Read-write never waits, and takes nothing: nothing reads it.
      holds = for path <- [out, err], do: hold(path)

      {:ok,
       %{
         worker: meta[:worker],
         holds: holds,
         fifos: fifos,
         streams: streams,
         meta: [vllm_pool: meta[:pool], vllm_worker: meta[:index], os_pid: nil],
         dropped: 0,
         draining: false
       }}
    else
      {:error, reason} ->
        unlink_fifos(fifos)
        {:stop, reason}
    end
  end

  defp mkfifo(path) do
    case System.cmd("mkfifo", ["-m", "600", path], stderr_to_stdout: true) do
      {_, 0} -> :ok
      {out, status} -> {:error, "mkfifo #{path} failed (status #{status}): #{out}"}
    end
  rescue
    e -> {:error, "mkfifo #{path} failed: #{Exception.message(e)}"}
  end

  @impl true
  def handle_cast({:os_pid, os_pid}, state),
    do: {:noreply, %{state | meta: Keyword.put(state.meta, :os_pid, os_pid)}}

  def handle_cast(:unlink, state) do
    unlink_fifos(state.fifos)
    {:noreply, release(state)}
  end

  @impl true
  def handle_info({port, {:data, data}}, %{streams: streams} = state)
      when is_map_key(streams, port) do
    {:message_queue_len, backlog} = Process.info(self(), :message_queue_len)

    if backlog > @max_backlog do
      {:noreply, %{state | dropped: state.dropped + byte_size(data)}}
    else
      state = report_dropped(state)
      stream = feed(streams[port], data, state.meta)
      {:noreply, %{state | streams: Map.put(streams, port, stream)}}
    end
  end

  def handle_info({port, {:exit_status, status}}, %{streams: streams} = state)
      when is_map_key(streams, port) do
    stream = streams[port]
    flush(stream, state.meta)
    state = %{state | streams: Map.delete(streams, port)}

    cond do
      state.draining and state.streams == %{} ->
        {:stop, :normal, state}

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
  def handle_info({:EXIT, worker, _reason}, %{worker: worker, draining: false} = state) do
    if state.streams == %{} do
      {:stop, :normal, state}
    else
      Process.send_after(self(), :drained, @drain_ms)
      {:noreply, %{state | draining: true}}
    end
  end

  def handle_info(:drained, state), do: {:stop, :normal, state}
  def handle_info(_other, state), do: {:noreply, state}

  @impl true
  def terminate(_reason, state) do
    # The names first: once its readers are gone, nothing of this worker is left.
    unlink_fifos(state.fifos)
    state = state |> release() |> report_dropped()

    for {port, stream} <- state.streams do
      flush(stream, state.meta)
      # A reader still blocked opening its FIFO (the Python process never opened it) or
      # kept open by a child process that outlives the worker.
      if stream.os_pid, do: VllmBridge.Worker.Launcher.kill(stream.os_pid)

      try do
        Port.close(port)
      rescue
        ArgumentError -> :ok
      end
    end

    :ok
  end

  defp hold(path) do
    {:ok, io} = :file.open(path, [:read, :write, :raw, :binary])
    io
  end

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

  defp port_os_pid(port) do
    case Port.info(port, :os_pid) do
      {:os_pid, pid} -> pid
      _ -> nil
    end
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

  # -- lines -------------------------------------------------------------------------------

  @doc false
  # Cuts `data` into lines after what `stream` held: every whole line is logged, the rest
  # is kept (at most @max_line bytes). Public for the tests of the cutting.
  @spec feed(map(), binary(), keyword()) :: map()
  def feed(stream, data, meta) do
    {lines, rest} = split(stream.buf <> data)
    skip = Enum.reduce(lines, stream.skip, fn line, skip -> line(stream, line, skip, meta) end)

    cond do
      skip ->
        # Still inside a line already cut: its rest is dropped up to its newline.
        %{stream | buf: "", skip: true}

      byte_size(rest) > @max_line ->
        emit(stream, cut(rest), meta)
        %{stream | buf: "", skip: true}

      true ->
        %{stream | buf: rest, skip: false}
    end
  end

  # A whole line: logged (unless it ends a line already cut); afterwards, no line is cut.
  defp line(_stream, _line, true, _meta), do: false

  defp line(stream, line, false, meta) do
    if byte_size(line) > @max_line,
      do: emit(stream, cut(line), meta),
      else: emit(stream, line, meta)

    false
  end

  defp cut(line) do
    binary_part(line, 0, @max_line) <> " [line cut at #{@max_line} bytes]"
  end

  defp split(bin) do
    case :binary.split(bin, ["\r\n", "\n", "\r"], [:global]) do
      [rest] -> {[], rest}
      parts -> {Enum.drop(parts, -1), List.last(parts)}
    end
  end

  defp flush(%{buf: ""}, _meta), do: :ok
  defp flush(stream, meta), do: emit(stream, stream.buf, meta)

  defp emit(_stream, "", _meta), do: :ok

  defp emit(stream, line, meta) do
    level = if stream.name == :stdout, do: :info, else: :warning
    text = scrub(line)

    Logger.log(level, fn -> "[python #{stream.name}] #{text}" end, [
      {:python_stream, stream.name} | meta
    ])
  end

  # Logger wants UTF-8: an invalid byte becomes U+FFFD.
  defp scrub(bin) do
    case :unicode.characters_to_binary(bin) do
      good when is_binary(good) ->
        good

      {_, good, <<_bad, rest::binary>>} ->
        good <> "\uFFFD" <> scrub(rest)

      {_, good, _} ->
        good
    end
  end
end
