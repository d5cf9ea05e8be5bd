defmodule VllmBridge.Worker do
  @moduledoc false
  # One Elixir process per Python worker OS process, and the only process that touches its
  # port (see `VllmBridge.Worker.Launcher` for how the process is started and ended).
  #
  # It starts in the phase :starting (VllmBridge.Worker.Starting): the port is open and
  # the first frame must be the Python process's hello (`VllmBridge.Worker.Hello`) within
  # `start_timeout`, then its `on_start` call (if any) must return within `start_timeout`.
  # Requests that arrive meanwhile wait in the state, in order (a caller that gives up
  # meanwhile has its own dropped and is answered at once), and so do callers of
  # `await_ready/2` and `hello/1`; then it is :ready (in a pool: registered, its slots
  # opened) and they are served. A start that fails is returned by `await_ready/2`; the
  # process stops with `{:shutdown, {:start_failed, error}}`, or, during its pool's first
  # start, stays in the phase :failed until the pool is stopped (not restarted meanwhile).
  #
  # Its whole job on the hot path: write a caller's pre-encoded request to the port and
  # record `id => caller` in its table of calls in flight; cut the port's bytes into frames
  # (`VllmBridge.Worker.Framer`), read a frame's kind and id (`VllmBridge.Call.Wire.peek/1`, not
  # a full decode) and send the frame as it is to the caller, who decodes it. Callers wait
  # in their own `receive`, on a process alias with a monitor on this process, each with
  # its own deadline.
  #
  #   * **Frame size.** A request frame over `:max_frame_bytes` is refused with
  #     `:bad_argument` instead of being written (a pool's callers are refused earlier,
  #     before a slot is reserved: `VllmBridge.Call.Route`). A header from the Python process
  #     declaring more means the stream cannot be trusted: the Python process is killed,
  #     every call in flight gets `:worker_exit` naming the length and the limit, and this
  #     process stops (its supervisor starts a new one).
  #
  #   * **Pipelining.** Several calls may be in flight at once; the Python side runs them one
  #     at a time, in order. In a pool, how many is bounded by `VllmBridge.Pool.Slots`, which
  #     this process releases as replies come in.
  #   * **Death.** When the Python process exits, or the port to it fails (it stopped
  #     reading: `:epipe`), every call in flight gets
  #     `{:error, %VllmBridge.Error{type: :worker_exit}}` saying so at once and this process
  #     stops; its supervisor starts a new one (a new Python process, a new `instance`).
  #   * **Timeouts, and callers that die.** A caller that gives up settles its call through
  #     here (`VllmBridge.Call.Request.give_up/2`: `:cancelled` comes back after any reply
  #     already passed on), and the calls of a caller that dies (a caller with calls in
  #     flight is monitored, once: VllmBridge.Worker.Calls) are cancelled the same way:
  #     Python drops a queued call and interrupts a running one where it is
  #     (docs/PROTOCOL.md, "Cancel"), so its slot comes back and the worker, its
  #     sessions and their state stay. A reply that still comes is dropped
  #     here, and the references in it (seen by nobody) are released in their sessions.
  #   * **`cancel_grace`.** A cancelled call still running `cancel_grace` ms later did not
  #     stop when interrupted: it is stuck in C code (interrupted only once it returns to
  #     Python), in an `__enter__` (never interrupted), or it caught the interruption. The
  #     Python process is then killed and the worker restarts; every call in flight on it,
  #     and every session lost with it, says why (which request, and `cancel_grace`). As
  #     with Ctrl-C, an interruption that lands in the interrupted code's own cleanup can
  #     leave that code's state half-reset; the worker's own state is never interrupted.
  #   * **Logs.** `log` frames go to `Logger` with the Python logger's name
  #     (VllmBridge.Worker.PythonLog); the Python process's stdout and stderr are read by
  #     a process beside this one (VllmBridge.Worker.Output), never through this mailbox.
  #
  # Start options: `:python`, `:worker_module`, `:allow`, `:max_refs`, `:poll_us`,
  # `:max_frame_bytes`, `:log_level`, `:env` (see `VllmBridge.Worker.Launcher.open/1`), `:on_start`
  # (`{module, function, args, kwargs}`), `:start_timeout`
  # (ms, default 60 000), `:cancel_grace` (ms, default 5 000), `:shutdown_grace` (ms the
  # Python process is given to exit on EOF before it is killed, default 3 000),
  # `:progress` (VllmBridge.Worker.Progress), and, in a pool, `:pool`, `:index` and `:meta`.
  use GenServer, restart: :permanent

  require Logger
  require VllmBridge.Worker.Messages

  alias VllmBridge.Error
  alias VllmBridge.Call.{Request, Runtime, Wire}
  alias VllmBridge.Pool.{Directory, Slots}
  alias VllmBridge.Worker.{Calls, Events, Framer, Hello, Launcher, Messages, PythonLog, Starting}
  alias VllmBridge.Worker.Messages.Submit

  @start_timeout 60_000
  @cancel_grace 5_000
  @shutdown_grace 3_000
  @sweep_every 1_000

  @typedoc "What the worker announced in its handshake."
  @type hello :: Hello.t()

  @doc """
  Starts a worker linked to the caller (options above). The handshake runs after. The
  worker stops when the caller exits, whatever the reason, and its Python process with it.
  """
  @spec start_link(keyword()) :: GenServer.on_start()
  def start_link(opts \\ []) do
    GenServer.start_link(__MODULE__, opts, Keyword.take(opts, [:name]))
  end

  @doc false
  @spec child_spec(keyword()) :: Supervisor.child_spec()
  def child_spec(opts) do
    %{
      id: {__MODULE__, Keyword.get(opts, :index, 0)},
      start: {__MODULE__, :start_link, [opts]},
      restart: :permanent,
      shutdown: Keyword.get(opts, :shutdown_grace, @shutdown_grace) + 2_000
    }
  end

  @doc """
  Waits until the start is done (the handshake, then `on_start`): `{:ok, hello}`, or the
  reason the worker could not start (a `VllmBridge.Error`). The worker enforces its own
  limits (`start_timeout` for each stage), so the default waits for them; with a
  `timeout` of its own, a worker still starting when it passes gives
  `{:error, %VllmBridge.Error{type: :timeout}}` naming the stage it was in.
  """
  @spec await_ready(GenServer.server(), timeout()) :: {:ok, hello()} | {:error, Error.t()}
  def await_ready(worker, timeout \\ :infinity) do
    GenServer.call(worker, :await_ready, timeout)
  catch
    :exit, {{:shutdown, {:start_failed, %Error{} = e}}, _} ->
      {:error, e}

    :exit, {reason, _} when reason in [:normal, :shutdown, :noproc] ->
      {:error, Error.new(:worker_exit, "the worker was stopped while it started")}

    :exit, {:timeout, _} ->
      stage = Starting.stage(worker)

      {:error,
       Error.new(
         :timeout,
         "the worker had not finished its start within #{timeout} ms (it was in its " <>
           "#{stage} stage)",
         details: %{stage: stage}
       )}

    :exit, {reason, _} ->
      {:error, Error.new(:worker_exit, "worker start failed: #{inspect(reason)}")}
  end

  @doc """
  The handshake the Python process announced (waits for the start to be done; exits as a
  call to a stopped worker would when the start failed).
  """
  @spec hello(GenServer.server()) :: hello()
  def hello(worker) do
    case await_ready(worker, :infinity) do
      {:ok, hello} -> hello
      {:error, e} -> exit({{:shutdown, {:start_failed, e}}, {__MODULE__, :hello, [worker]}})
    end
  end

  @doc "The OS pid of the Python process."
  @spec os_pid(GenServer.server()) :: non_neg_integer()
  def os_pid(worker), do: Map.fetch!(hello(worker), "pid")

  @doc """
  Calls `module.name(*args, **kwargs)` in this worker directly (no pool, no session) and
  waits up to `timeout` ms. Results decode with `VllmBridge.Codec`.
  """
  @spec call(GenServer.server(), String.t(), String.t(), list(), map() | keyword(), timeout()) ::
          {:ok, term()} | {:error, Error.t()}
  def call(worker, module, name, args \\ [], kwargs \\ %{}, timeout \\ 5_000) do
    pid = GenServer.whereis(worker)
    deadline = Runtime.deadline(System.monotonic_time(:millisecond), timeout)

    with {:ok, parts} <- Wire.encode_invoke({module, name}, args, kwargs) do
      req = Request.new("call", pre: [Wire.value(nil)], post: parts, target: {module, name})
      Request.call(pid, req, deadline)
    end
  end

  @doc """
  Sends `ping` and returns the worker's status map (`"running"`, `"queued"`,
  `"sessions"`, `"refs"`); answered by the worker's reader thread even while a call runs.
  """
  @spec ping(GenServer.server(), timeout()) :: {:ok, map()} | {:error, Error.t()}
  def ping(worker, timeout \\ 5_000) do
    deadline = Runtime.deadline(System.monotonic_time(:millisecond), timeout)
    Request.call(GenServer.whereis(worker), Request.new("ping", timed: false), deadline)
  end

  @doc "Closes the port; the Python process sees EOF and exits. The worker stops."
  @spec close(GenServer.server()) :: :ok
  def close(worker), do: GenServer.call(worker, :close, :infinity)

  @doc false
  # What this process knows of itself, for VllmBridge.Pool.Status: never waits on Python.
  @spec local_status(GenServer.server(), timeout()) :: map()
  def local_status(worker, timeout), do: GenServer.call(worker, :status, timeout)

  @doc false
  @spec status(map()) :: map()
  def status(state) do
    %{
      phase: state.phase,
      os_pid: state.os_pid,
      device: state.hello && state.hello["device"],
      in_flight: Calls.size(state.calls),
      calls: Calls.targets(state.calls)
    }
  end

  @doc "How many calls this worker has in flight (its table), for tests and diagnostics."
  @spec in_flight(GenServer.server()) :: non_neg_integer()
  def in_flight(worker), do: GenServer.call(worker, :in_flight)

  # -- server ------------------------------------------------------------------

  @impl true
  def init(opts) do
    defaults = [
      start_timeout: @start_timeout,
      cancel_grace: @cancel_grace,
      shutdown_grace: @shutdown_grace
    ]

    Starting.init(Keyword.merge(defaults, opts))
  end

  @impl true
  def handle_call(request, from, %{phase: phase} = state) when phase != :ready,
    do: Starting.handle_call(request, from, state)

  def handle_call(:await_ready, _from, state), do: {:reply, {:ok, state.hello}, state}
  def handle_call(:in_flight, _from, state), do: {:reply, Calls.size(state.calls), state}
  def handle_call(:status, _from, state), do: {:reply, status(state), state}

  def handle_call(:close, _from, state) do
    {:stop, :normal, :ok, shut(state, "the worker was closed")}
  end

  @impl true
  def handle_info(message, %{phase: phase} = state) when phase != :ready,
    do: Starting.handle_info(message, state)

  def handle_info({port, {:data, data}}, %{port: port} = state) do
    case Framer.whole(state.framer, data, state.max_frame) do
      nil -> feed(state, data)
      body -> {:noreply, route(state, body)}
    end
  end

  def handle_info(Messages.submit(s), state), do: {:noreply, submit(state, s)}

  # A stream's consumer gives room back (VllmBridge.Stream): passed on while it is live.
  def handle_info(Messages.credit(id, n), state) do
    if Calls.live(state.calls, id),
      do: Port.command(state.port, Wire.request("credit", id, [Wire.value(n)]))

    {:noreply, state}
  end

  # A caller gives up (VllmBridge.Call.Request.give_up/2, or a stream that stops): cancel
  # as below, then answer, always. A reply already passed on reaches the caller first.
  def handle_info(Messages.settle(id, alias), state) do
    state = cancel(state, id)
    Messages.send_cancelled(alias)
    {:noreply, state}
  end

  def handle_info(Messages.grace(id), state) do
    case Calls.overstayed(state.calls, id, state.cancel_grace) do
      nil ->
        {:noreply, state}

      overstayed ->
        why = "the Python process (os pid #{state.os_pid}) was killed because #{overstayed}"

        Logger.warning(
          "vllm_bridge worker #{label(state)}: #{why}; the worker restarts",
          VllmBridge.Worker.LogMeta.of(state)
        )

        Launcher.kill(state.os_pid)
        # Every call that loses its worker, and every session lost with it, says why.
        {:noreply, %{state | killed: why}}
    end
  end

  # A caller died: cancel its live calls as if they had timed out.
  def handle_info({:DOWN, mon, :process, caller, _reason}, state) do
    {ids, calls} = Calls.abandoned(state.calls, mon, caller)
    {:noreply, Enum.reduce(ids, %{state | calls: calls}, &cancel(&2, &1))}
  end

  def handle_info(:sweep, state) do
    Process.send_after(self(), :sweep, @sweep_every)
    now = System.monotonic_time(:millisecond)
    {overdue, calls} = Calls.sweep(state.calls, now, @sweep_every)
    {:noreply, Enum.reduce(overdue, %{state | calls: calls}, &cancel(&2, &1))}
  end

  def handle_info({port, {:exit_status, status}}, %{port: port} = state) do
    down(
      %{state | port: nil},
      "the Python worker exited with status #{status} (os pid #{state.os_pid})"
    )
  end

  # The port closed after its process exited: the exit status comes (or came) first.
  def handle_info({:EXIT, port, :normal}, %{port: port} = state) when is_port(port) do
    {:noreply, state}
  end

  # The port failed (`:epipe`: a write the Python process no longer reads, because it
  # stopped reading or is on its way out): no frame can reach it any more.
  def handle_info({:EXIT, port, reason}, %{port: port} = state) when is_port(port) do
    down(
      state,
      "the port to the Python process (os pid #{state.os_pid}) failed " <>
        "(#{inspect(reason)}): it no longer reads its requests (see its stderr)"
    )
  end

  # The process that reads the Python process's stdout and stderr is gone: what the
  # Python process writes there would fail (a broken pipe), so it starts again.
  def handle_info({:EXIT, output, reason}, %{output: output} = state) when is_pid(output) do
    down(
      %{state | output: nil},
      "the reader of its stdout and stderr stopped (#{inspect(reason)})"
    )
  end

  def handle_info(_other, state), do: {:noreply, state}

  @impl true
  def terminate(reason, state) do
    Events.ended(state, reason, Calls.size(state.calls))
    shut(state, "the worker is shutting down")
    # A start cut short (the pool stopped meanwhile) leaves no start-up stderr file.
    if state[:stderr], do: Launcher.delete_stderr(state.stderr)
    :ok
  end

  @doc false
  # How often the table of calls in flight is swept (ms; VllmBridge.Worker.Calls.sweep/3).
  @spec sweep_every() :: pos_integer()
  def sweep_every, do: @sweep_every

  # -- requests and frames ---------------------------------------------------------------

  @doc false
  # A request from a caller (VllmBridge.Call.Request): written to the port and put in the
  # table of calls in flight (VllmBridge.Worker.Calls), unless the table refuses it. A
  # stream's reader is told the window first (before any chunk can reach it).
  @spec submit(map(), Submit.t()) :: map()
  def submit(state, %Submit{} = s) do
    # (A body too long to be framed, frame nil, is over any limit: `max_frame` is capped
    # at what a frame's length can say.)
    case Calls.admit(state.calls, s, state.max_frame) do
      {:ok, calls} ->
        if s.replies == :stream, do: Messages.send_window(s.alias, state.stream_window)
        Port.command(state.port, s.frame)
        %{state | calls: Calls.add(calls, s)}

      {:refused, calls} ->
        %{state | calls: calls}
    end
  end

  @doc false
  # One whole frame: a reply or chunk goes to its caller as it is (the caller decodes it).
  @spec route(map(), binary()) :: map()
  def route(state, bin) do
    case Wire.peek(bin) do
      {kind, id} when kind in [:ok, :error, :pong] and id != nil ->
        %{state | calls: Calls.finish(state.calls, id, :reply, bin)}

      {:chunk, id} when id != nil ->
        case Calls.live(state.calls, id) do
          nil -> Calls.drop(bin)
          alias -> Messages.send_chunk(alias, bin)
        end

        state

      {:end, id} when id != nil ->
        %{state | calls: Calls.finish(state.calls, id, :end, nil)}

      {:log, _} ->
        PythonLog.emit(bin, state)
        state

      other ->
        Logger.warning(
          "vllm_bridge worker #{label(state)}: frame without a call to answer " <>
            "(#{inspect(other)}): #{inspect(VllmBridge.Codec.decode(bin), limit: 12)}",
          VllmBridge.Worker.LogMeta.of(state)
        )

        state
    end
  end

  # Chunks that are not one whole frame: the framer's general path.
  defp feed(state, data) do
    case Framer.feed(state.framer, data, state.max_frame) do
      {:ok, [frame], framer} ->
        {:noreply, route(%{state | framer: framer}, frame)}

      {:ok, frames, framer} ->
        {:noreply, Enum.reduce(frames, %{state | framer: framer}, &route(&2, &1))}

      {:too_large, len, frames} ->
        state = Enum.reduce(frames, state, &route(&2, &1))
        # Killed first: it must not go on writing into a stream nobody reads.
        Launcher.kill(state.os_pid)
        down(state, Launcher.too_large_message(state.os_pid, len, state.max_frame))
    end
  end

  # The caller gave up, died, or its call is overdue: cancel it (Python drops it if
  # queued, interrupts it if running), and restart the Python process if the call still
  # runs `cancel_grace` ms from now.
  defp cancel(state, id) do
    case Calls.cancel(state.calls, id, System.monotonic_time(:millisecond)) do
      {:cancelled, calls} ->
        Port.command(state.port, Wire.request("cancel", id, []))
        Process.send_after(self(), Messages.grace(id), state.cancel_grace)
        %{state | calls: calls}

      :not_live ->
        state
    end
  end

  @doc false
  # The directory forgets this worker (keeping why) and its slots go down; only then
  # does everything in flight get :worker_exit, so that a caller that retries at once
  # finds it gone (its session lost, saying why) instead of reserving on it. The Python
  # process is closed (and killed if it lingers). Requests still in this mailbox see the
  # stop reason, `{:shutdown, {:worker_exit, message}}` (Request.worker_down/1).
  @spec shut(map(), String.t()) :: map()
  def shut(state, message) do
    if state.meta do
      Directory.worker_down(state.pool, state.index, state.instance, message)
      Slots.put_load(state.meta, state.index, Slots.down())
    end

    calls = Calls.fail_all(state.calls, message)

    if state.port, do: Launcher.close(state.port, state.os_pid, state.shutdown_grace)
    # Down once: terminate/2 runs this again, and must not overwrite the reason recorded.
    %{state | calls: calls, port: nil, instance: nil}
  end

  # The worker goes down: logged, every caller told why (the grace kill's reason, when
  # that is what ended it), and this process stops (its supervisor starts a new one).
  defp down(state, event) do
    Logger.error(
      "vllm_bridge worker #{label(state)}: #{event}; #{Calls.size(state.calls)} call(s) " <>
        "in flight get :worker_exit and the worker restarts",
      VllmBridge.Worker.LogMeta.of(state)
    )

    why = state.killed || event
    Events.exited(state, why, Calls.size(state.calls))
    {:stop, {:shutdown, {:worker_exit, why}}, shut(state, why)}
  end

  @doc false
  @spec label(map()) :: String.t()
  def label(%{pool: nil, os_pid: os_pid}), do: "(os pid #{os_pid})"
  def label(%{pool: pool, index: index}), do: "#{inspect(pool)}[#{index}]"
end
