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
  #     declaring more ends the worker (VllmBridge.Worker.Down).
  #   * **Pipelining.** Several calls may be in flight at once; the Python side runs them one
  #     at a time, in order. In a pool, how many is bounded by `VllmBridge.Pool.Slots`, which
  #     this process releases as replies come in.
  #   * **Death.** When the Python process exits, or the port to it fails, every call in
  #     flight gets `:worker_exit` at once and this process stops; its supervisor starts a
  #     new one (VllmBridge.Worker.Down).
  #   * **Timeouts, callers that die, and `cancel_grace`.** A call whose caller gives up or
  #     dies is cancelled in Python, and the Python process is killed when the call does
  #     not stop within `cancel_grace` (VllmBridge.Worker.Cancel).
  #   * **Result slots of callers that die.** A reply or chunk that names result slots
  #     (found without decoding it; a small frame pays one search) has them remembered
  #     with its caller, who is monitored: a caller that dies before decoding it has them
  #     handed back (VllmBridge.Shm.Loans).
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
  alias VllmBridge.Shm.Loans
  alias VllmBridge.Worker.{Calls, Cancel, Down, Events, Framer, Hello, Intake, Launcher}
  alias VllmBridge.Worker.Messages
  alias VllmBridge.Worker.{PythonLog, Starting, Unclaimed}
  alias VllmBridge.Worker.Messages.Submit

  @start_timeout 60_000
  @cancel_grace 5_000
  @shutdown_grace 3_000

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
      # The grace to exit on EOF, the wait for those killed after it to be gone, and
      # time for the rest of the worker's terminate (telemetry, logging).
      shutdown: Keyword.get(opts, :shutdown_grace, @shutdown_grace) + Launcher.reap_ms() + 2_000
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
      # The Python process's (its rss in VllmBridge.Pool.Status), as Worker.os_pid/1.
      os_pid: state.python_pid || state.os_pid,
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
    {:stop, :normal, :ok, Down.shut(state, "the worker was closed")}
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

  def handle_info(Messages.submit(s), state), do: {:noreply, Intake.arrived(state, s)}

  # A stream's consumer gives room back (VllmBridge.Stream): passed on while it is live.
  def handle_info(Messages.credit(id, n), state) do
    if Calls.live(state.calls, id),
      do: Intake.write(state, Wire.request("credit", id, [Wire.value(n)]))

    {:noreply, state}
  end

  # The calls that end without their reply (VllmBridge.Worker.Cancel).
  def handle_info(Messages.settle(id, alias), state),
    do: {:noreply, Cancel.settle(state, id, alias)}

  def handle_info(Messages.grace(id), state), do: {:noreply, Cancel.grace(state, id)}

  # A caller died: its frames' result slots still lent go back (VllmBridge.Shm.Loans),
  # or its calls are cancelled (the monitors of VllmBridge.Worker.Calls).
  def handle_info({:DOWN, mon, :process, caller, _reason}, state) do
    case Loans.down(state.loans, mon, caller) do
      {:ok, loans} -> {:noreply, %{state | loans: loans}}
      :error -> {:noreply, Cancel.abandoned(state, mon, caller)}
    end
  end

  def handle_info(:sweep, state),
    do: {:noreply, Cancel.sweep(%{state | loans: Loans.prune(state.loans)})}

  # The worker's end (VllmBridge.Worker.Down).
  def handle_info({port, {:exit_status, status}}, %{port: port} = state),
    do: Down.exited(state, status)

  # The port closed after its process exited: the exit status comes (or came) first.
  def handle_info({:EXIT, port, :normal}, %{port: port} = state) when is_port(port) do
    {:noreply, state}
  end

  def handle_info({:EXIT, port, reason}, %{port: port} = state) when is_port(port),
    do: Down.port_failed(state, reason)

  def handle_info({:EXIT, output, reason}, %{output: output} = state) when is_pid(output),
    do: Down.output_stopped(state, reason)

  def handle_info(_other, state), do: {:noreply, state}

  @impl true
  def terminate(reason, state) do
    Events.ended(state, reason, Calls.size(state.calls))
    Down.shut(state, "the worker is shutting down")
    # A start cut short (the pool stopped meanwhile) leaves no start-up stderr file.
    if state[:stderr], do: Launcher.delete_stderr(state.stderr)
    :ok
  end

  # -- requests and frames ---------------------------------------------------------------

  @doc false
  # A request from a caller (VllmBridge.Call.Request): written to the port and put in the
  # table of calls in flight (VllmBridge.Worker.Calls), unless the table refuses it.
  @spec submit(map(), Submit.t()) :: map()
  def submit(state, %Submit{} = s), do: Intake.one(state, s)

  @doc false
  # One whole frame: a reply or chunk goes to its caller as it is (the caller decodes it).
  @spec route(map(), binary()) :: map()
  def route(state, bin) do
    case Wire.peek(bin) do
      {kind, id} when kind in [:ok, :error, :pong] and id != nil ->
        state = lend(state, id, bin)
        %{state | calls: Calls.finish(state.calls, id, :reply, bin, state.origin)}

      {:chunk, id} when id != nil ->
        case Calls.live(state.calls, id) do
          nil ->
            Unclaimed.drop(bin, state.origin)
            state

          alias ->
            state = lend(state, id, bin)
            Messages.send_chunk(alias, bin, state.origin)
            state
        end

      {:end, id} when id != nil ->
        %{state | calls: Calls.finish(state.calls, id, :end, nil, state.origin)}

      {:log, _} ->
        PythonLog.emit(bin, state)
        state

      head ->
        Logger.warning(
          "vllm_bridge worker #{label(state)}: frame without a call to answer " <>
            "(#{stray(head, bin)})",
          VllmBridge.Worker.LogMeta.of(state)
        )

        state
    end
  end

  # A frame that answers no call, in words that cost what its head does: its kind, its
  # id, its size and its first bytes in hex. Never decoded here: the frame is untrusted,
  # and printing a decoded value can take seconds (an integer prints in quadratic time).
  defp stray({kind, id}, bin) do
    kind = if kind == :unknown, do: "unknown kind", else: Atom.to_string(kind)
    id = if id, do: "id #{id}", else: "no id"
    size = byte_size(bin)
    hex = Base.encode16(binary_part(bin, 0, min(size, 16)), case: :lower)
    "#{kind}, #{id}; #{size} bytes: #{hex}#{if size > 16, do: "..."}"
  end

  # A frame about to go to the caller of call `id`: the result slots it names (if any)
  # are remembered for that caller, before it can die with the frame unread
  # (VllmBridge.Shm.Loans). A frame nobody waits for is not: Calls hands its slots back.
  defp lend(%{loans: nil} = state, _id, _bin), do: state

  defp lend(%{loans: loans} = state, id, bin) do
    case Loans.names(loans, bin) do
      [] -> state
      names -> %{state | loans: Loans.lend(loans, Calls.caller(state.calls, id), names)}
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
        Down.too_large(state, len)
    end
  end

  @doc false
  @spec label(map()) :: String.t()
  def label(%{pool: nil, os_pid: os_pid}), do: "(os pid #{os_pid})"
  def label(%{pool: pool, index: index}), do: "#{inspect(pool)}[#{index}]"
end
