defmodule VllmBridge.Worker.Starting do
  @moduledoc false
  # The first phase of a worker process (VllmBridge.Worker): its port is open and the
  # Python process must send its hello within `start_timeout`, then, when the pool has an
  # `on_start`, run that call within `start_timeout` more. The start is a state of the
  # worker process, not a wait inside it: requests that arrive meanwhile are kept in the
  # state, in order, and so are the callers of `await_ready` and `close`; a caller that
  # gives up meanwhile has its request dropped here and is answered at once. Only then is
  # the worker :ready (in a pool: registered, its slots opened), and what waited is served.
  #
  # `on_start` is an ordinary `call` request (VllmBridge.Worker.OnStart) whose reply comes
  # back here as `{alias, :reply, frame, origin}`. Its result is dropped (references in it released).
  #
  # A start that fails (no hello, a bad one, an on_start that raises or overstays) is
  # handled by VllmBridge.Worker.StartFailure: logged once, with the last lines of the Python process's stderr when it ended before
  # its hello (the launcher sends start-up stderr to a private file: Launcher.stderr_tail/1).
  # Then:
  #   * a worker of a pool that `VllmBridge.Pool.start/2` is still starting stays, in the
  #     phase :failed, answering `await_ready` with the error (and every request with it)
  #     until start/2 stops the pool: its supervisor does not restart it over and over
  #     while start/2 waits, and the error is reported once;
  #   * any other (a restart in a running pool, a worker outside a pool) stops with
  #     `{:shutdown, {:start_failed, error}}`; a pool's supervisor starts it again.

  require Logger
  require VllmBridge.Worker.Messages

  alias VllmBridge.{Error, Ref}
  alias VllmBridge.Pool.{Directory, Slots}
  alias VllmBridge.Worker
  alias VllmBridge.Call.{Request, Wire}
  alias VllmBridge.Worker.{Calls, Events, Framer, Hello, Launcher, Messages, OnStart, OsProcess}
  alias VllmBridge.Worker.{Cancel, Down, Output, Progress, StartFailure}

  # The worker module whose start-up stderr is captured: ours takes its stderr FIFO back
  # after its hello (vllm_bridge.bridge.worker.stderr). A module of one's own has its
  # stderr on the FIFO from the start (VllmBridge.Worker.Output reads it).
  @own_worker "vllm_bridge.bridge.worker"

  @doc false
  # Opens the port and arms the start timeout: the worker process's first state. `opts`
  # has the defaults of start_timeout, cancel_grace and shutdown_grace.
  @spec init(keyword()) :: {:ok, map()} | {:stop, term()}
  def init(opts) do
    pool = Keyword.get(opts, :pool)
    index = Keyword.get(opts, :index, 0)
    meta = Keyword.get(opts, :meta)

    # The port's failure comes as a message (its callers are then told why), and
    # shutting down runs terminate/2 (callers told, Python process gone): when a pool's
    # supervisor stops this process, and when a standalone worker's owner (the process
    # that started it, linked) exits, whatever its reason.
    Process.flag(:trap_exit, true)

    # Processes that ran at this index of the pool before this one (its restarts): for the
    # telemetry events (VllmBridge.Worker.Events) and VllmBridge.Pool.status/2.
    restarts =
      if meta do
        Slots.put_load(meta, index, Slots.down())
        Directory.clear_worker(pool, index)
        # No slot names for this index until its hello says it reads the directory.
        VllmBridge.Shm.mark(meta, index, false)
        if meta.starts, do: :atomics.add_get(meta.starts, index + 1, 1) - 1, else: 0
      else
        0
      end

    stderr =
      if Keyword.get(opts, :worker_module, @own_worker) == @own_worker,
        do: Launcher.stderr_file()

    started_at = System.monotonic_time()

    with {:ok, output, fifos} <- start_output(pool, index, stderr),
         opened_at = OsProcess.now(),
         {:ok, port} <- Launcher.open(opts ++ [stderr_file: stderr, output: fifos]) do
      os_pid = Launcher.os_pid(port)
      procs = OsProcess.spawned(os_pid, opened_at)
      Output.os_pid(output, os_pid)
      Output.procs(output, procs)
      put_stage("handshake")
      start_timeout = Keyword.fetch!(opts, :start_timeout)
      Process.send_after(self(), Messages.start_timeout(:hello), start_timeout)

      state = %{
        phase: :starting,
        port: port,
        framer: Framer.new(),
        max_frame: min(Launcher.max_frame_bytes(opts), Wire.max_body_size()),
        # The port's own OS process.
        os_pid: os_pid,
        # The pid the hello announced once checked (VllmBridge.Worker.Hello.check_pid/3):
        # os_pid, or the Python process under a python: wrapper that forks it.
        python_pid: nil,
        # {max_frame, python_pid} once the hello came: sent with every reply and chunk
        # (VllmBridge.Worker.Messages; built once, so a reply allocates nothing for it).
        origin: nil,
        # Those processes by pid and start time: the only ones this side ever kills.
        procs: procs,
        # The process that logs the Python process's stdout and stderr.
        output: output,
        # When this start began (native units), and who hears of its progress.
        started_at: started_at,
        progress: Progress.new(pool, index, meta, Keyword.get(opts, :progress)),
        hello: nil,
        instance: nil,
        # Chunks a stream may run ahead of its reader: the hello's.
        stream_window: nil,
        pool: pool,
        index: index,
        meta: meta,
        calls: Calls.new(meta, index),
        # The result slots in frames passed to callers (VllmBridge.Shm.Loans; set at the
        # hello, nil for a worker that writes none).
        loans: nil,
        # While starting: the requests that came (newest first) and the callers of
        # await_ready/2 and close/1 (newest first), served once the start is done.
        pending: [],
        waiting: [],
        # The start-up stderr file (nil once deleted, or when not captured).
        stderr: stderr,
        # {module, function, args, kwargs} or nil, and the alias its reply comes to
        # while it runs.
        on_start: Keyword.get(opts, :on_start),
        setup: nil,
        # Why the start failed (the phase :failed).
        failed: nil,
        # Why the Python process was killed, once this process killed it (cancel_grace).
        killed: nil,
        # For the telemetry events (VllmBridge.Worker.Events): how long the hello took
        # (native, from started_at) and the processes at this index before this one.
        handshake_time: nil,
        restarts: restarts,
        start_timeout: start_timeout,
        cancel_grace: Keyword.fetch!(opts, :cancel_grace),
        shutdown_grace: Keyword.fetch!(opts, :shutdown_grace)
      }

      Process.send_after(self(), :progress_tick, Progress.tick_ms())
      {:ok, Progress.report(state, :launch)}
    else
      {:error, %Error{} = e} ->
        Launcher.delete_stderr(stderr)
        {:stop, {:shutdown, {:start_failed, e}}}

      {:error, reason} ->
        Launcher.delete_stderr(stderr)

        {:stop,
         {:shutdown,
          {:start_failed,
           Error.new(:worker_exit, "the worker's output could not be set up: #{inspect(reason)}")}}}
    end
  end

  defp start_output(pool, index, stderr) do
    case Output.start_link(pool: pool, index: index, stderr_file: stderr) do
      {:ok, pid, fifos} -> {:ok, pid, fifos}
      {:error, reason} -> {:error, reason}
    end
  end

  # While starting (or failed), the phase's own module answers.
  @spec handle_call(term(), GenServer.from(), map()) :: tuple()
  def handle_call(:await_ready, _from, %{phase: :failed} = state),
    do: {:reply, {:error, state.failed}, state}

  def handle_call(:close, _from, %{phase: :failed} = state),
    do: {:stop, :normal, :ok, state}

  def handle_call(request, from, state)
      when request in [:await_ready, :close],
      do: {:noreply, %{state | waiting: [{from, request} | state.waiting]}}

  def handle_call(:in_flight, _from, state), do: {:reply, Calls.size(state.calls), state}
  def handle_call(:status, _from, state), do: {:reply, Worker.status(state), state}

  @spec handle_info(term(), map()) :: tuple()
  def handle_info(message, %{phase: :failed} = state), do: failed_info(message, state)

  def handle_info({port, {:data, data}}, %{port: port, hello: nil} = state) do
    case Framer.feed(state.framer, data, state.max_frame) do
      {:ok, [], framer} ->
        {:noreply, %{state | framer: framer}}

      {:ok, [hello | frames], framer} ->
        with {:ok, hello} <- Hello.check(hello, state.max_frame),
             {:ok, procs} <- Hello.check_pid(hello, state.os_pid, state.procs) do
          hello(%{state | framer: framer, procs: procs}, hello, frames)
        else
          {:error, e} -> start_failed(state, e)
        end

      {:too_large, len, _frames} ->
        start_failed(
          state,
          Error.new(:protocol, Launcher.too_large_message(state.os_pid, len, state.max_frame))
        )
    end
  end

  # After the hello, while on_start runs: frames are routed as when ready (its reply
  # reaches this process's alias; log records are logged).
  def handle_info({port, {:data, data}}, %{port: port} = state) do
    case Framer.feed(state.framer, data, state.max_frame) do
      {:ok, frames, framer} ->
        {:noreply, Enum.reduce(frames, %{state | framer: framer}, &Worker.route(&2, &1))}

      {:too_large, len, _frames} ->
        start_failed(
          state,
          Error.new(:protocol, Launcher.too_large_message(state.os_pid, len, state.max_frame))
        )
    end
  end

  def handle_info(Messages.reply(alias, bin, origin), %{setup: alias} = state) do
    case Wire.decode_reply(bin, origin, self()) do
      {:ok, value} ->
        # Nobody reads the result: references in it are released (queued until ready),
        # from the value decoded here (a second decode would find its slots gone).
        Request.cast_release(self(), Ref.collect(value))
        ready(%{state | setup: nil})

      {:error, e} ->
        start_failed(state, OnStart.error(state.on_start, e))
    end
  end

  def handle_info(Messages.reply_error(alias, e), %{setup: alias} = state),
    do: start_failed(state, OnStart.error(state.on_start, e))

  def handle_info({port, {:exit_status, status}}, %{port: port} = state) do
    state = %{state | port: nil}

    case state.setup do
      nil ->
        start_failed(state, Hello.exited(status, Launcher.stderr_tail(state.stderr)))

      _running ->
        e = Error.new(:worker_exit, "the Python worker exited with status #{status}")
        start_failed(state, OnStart.error(state.on_start, e))
    end
  end

  def handle_info(Messages.start_timeout(:hello), %{hello: nil} = state) do
    # Killed first, so that its stderr is complete when read.
    state = kill(state)
    start_failed(state, Hello.timed_out(state.os_pid, state.start_timeout, stderr_tail(state)))
  end

  def handle_info(Messages.start_timeout(:on_start), %{setup: setup} = state)
      when setup != nil do
    start_failed(
      kill(state),
      OnStart.error(state.on_start, OnStart.timed_out(state.start_timeout))
    )
  end

  def handle_info(Messages.submit(s), state),
    do: {:noreply, %{state | pending: [s | state.pending]}}

  # A caller gives up before the worker is ready: its request, still waiting here, is
  # dropped (its slot given back), and it is answered at once.
  def handle_info(Messages.settle(id, alias), state) do
    {dropped, pending} = Enum.split_with(state.pending, &(&1.id == id))
    if Enum.any?(dropped, & &1.holds_slot), do: Calls.release(state.calls)
    Messages.send_cancelled(alias)
    {:noreply, %{state | pending: pending}}
  end

  def handle_info(:progress_tick, %{phase: :starting} = state) do
    Process.send_after(self(), :progress_tick, Progress.tick_ms())
    waiting_for = if state.hello, do: :on_start, else: :handshake
    {:noreply, Progress.report(state, :waiting, %{waiting_for: waiting_for})}
  end

  # Anything else (the port's own EXIT follows its exit status, a stale timer) waits.
  def handle_info(_other, state), do: {:noreply, state}

  # The hello came: the start-up stderr file goes (the Python process holds it open and
  # copies it to its stderr FIFO itself), then on_start runs, or the worker is ready.
  defp hello(state, hello, frames) do
    Launcher.delete_stderr(state.stderr)
    Output.unlink(state.output)
    # The pid it named is the worker's, to be killed if left when this process is gone.
    Output.procs(state.output, state.procs)

    state = %{
      state
      | hello: hello,
        instance: hello["instance"],
        python_pid: hello["pid"],
        origin: {state.max_frame, hello["pid"]},
        stream_window: Hello.stream_window(hello),
        handshake_time: System.monotonic_time() - state.started_at,
        stderr: nil,
        loans: VllmBridge.Shm.Loans.new(hello)
    }

    if state.meta, do: VllmBridge.Shm.mark(state.meta, state.index, VllmBridge.Shm.reads?(hello))

    # The frames that came with the hello (a log record, say) as if they came after it.
    state = Enum.reduce(frames, state, &Worker.route(&2, &1))
    state = Progress.report(state, :handshake)

    case state.on_start do
      nil -> ready(state)
      on_start -> run_on_start(state, on_start)
    end
  end

  defp run_on_start(state, on_start) do
    case OnStart.request(on_start, state.start_timeout) do
      {:ok, alias, submit} ->
        Process.send_after(self(), Messages.start_timeout(:on_start), state.start_timeout)
        put_stage("on_start")
        state = Progress.report(state, :on_start)
        {:noreply, Worker.submit(%{state | setup: alias}, submit)}

      {:error, e} ->
        start_failed(state, OnStart.error(on_start, e))
    end
  end

  # The start is done: registered (in a pool) and open for calls; what waited is served in
  # the order it came.
  defp ready(state) do
    if state.setup, do: :erlang.unalias(state.setup)
    put_stage("ready")
    state = %{state | phase: :ready, setup: nil}
    state = Progress.report(state, :ready)

    if state.meta do
      Directory.worker_up(state.pool, state.index, self(), state.instance)
      Slots.put_load(state.meta, state.index, 0)
      Slots.kick(state.meta)
    end

    # Once it takes calls: a handler may look it up (VllmBridge.Pool.workers/1).
    Events.started(state)

    Process.send_after(self(), :sweep, Cancel.sweep_every())

    state =
      state.pending
      |> Enum.reverse()
      |> Enum.reduce(%{state | pending: []}, &Worker.submit(&2, &1))

    waiting = Enum.reverse(state.waiting)
    state = %{state | waiting: []}
    for {from, :await_ready} <- waiting, do: GenServer.reply(from, {:ok, state.hello})

    case for {from, :close} <- waiting, do: from do
      [] ->
        {:noreply, state}

      closers ->
        state = Down.shut(state, "the worker was closed")
        for from <- closers, do: GenServer.reply(from, :ok)
        {:stop, :normal, state}
    end
  end

  # The stage of the start, where a waiter that gave up can read it without asking this
  # process (which, when it is asked, is not answering): its process dictionary.
  @stage_key :vllm_bridge_start_stage
  defp put_stage(stage), do: Process.put(@stage_key, stage)

  @doc false
  # The start stage of worker `worker` ("handshake", "on_start", "ready"), read from the
  # outside; "unknown" for a process that is gone.
  @spec stage(GenServer.server()) :: String.t()
  def stage(worker) do
    with pid when is_pid(pid) <- GenServer.whereis(worker),
         {:dictionary, dict} <- Process.info(pid, :dictionary),
         {@stage_key, stage} <- List.keyfind(dict, @stage_key, 0) do
      stage
    else
      _ -> "unknown"
    end
  end

  defp kill(state), do: StartFailure.kill(state)
  defp stderr_tail(state), do: Launcher.stderr_tail(state.stderr)
  defp start_failed(state, e), do: StartFailure.start_failed(state, e)
  defp failed_info(message, state), do: StartFailure.info(message, state)
end
