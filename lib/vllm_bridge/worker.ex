defmodule VllmBridge.Worker do
  @moduledoc """
  One Elixir process per Python worker OS process, and the only process that touches its
  port (see `VllmBridge.Worker.Launcher` for how the process is started and ended).

  Its whole job on the hot path: write a caller's pre-encoded request to the port and
  record `id => caller` in its table of calls in flight; cut the port's bytes into frames
  (`VllmBridge.Worker.Framer`), read a frame's kind and id (`VllmBridge.Call.Wire.peek/1`, not
  a full decode) and send the frame as it is to the caller, who decodes it. Callers wait
  in their own `receive`, on a process alias with a monitor on this process, each with
  its own deadline.

    * **Frame size.** A request frame over `:max_frame_bytes` is refused with
      `:bad_argument` instead of being written (a pool's callers are refused earlier,
      before a slot is reserved: `VllmBridge.Call.Route`). A header from the Python process
      declaring more means the stream cannot be trusted: the Python process is killed,
      every call in flight gets `:worker_exit` naming the length and the limit, and this
      process stops (its supervisor starts a new one).

    * **Pipelining.** Several calls may be in flight at once; the Python side runs them one
      at a time, in order. In a pool, how many is bounded by `VllmBridge.Pool.Slots`, which
      this process releases as replies come in.
    * **Death.** When the Python process exits, or the port to it fails (it stopped
      reading: `:epipe`), every call in flight gets
      `{:error, %VllmBridge.Error{type: :worker_exit}}` saying so at once and this process
      stops; its supervisor starts a new one (a new Python process, a new `instance`).
    * **Timeouts, and callers that die.** A caller that gives up settles its call through
      here (`VllmBridge.Call.Request.give_up/2`: `:cancelled` comes back after any reply
      already passed on), and the calls of a caller that dies (each waiting caller is
      monitored) are cancelled the same way: Python drops a queued call and interrupts a
      running one where it is (docs/PROTOCOL.md, "Cancel"), so its slot comes back and
      the worker, its sessions and their state stay. A reply that still comes is dropped
      here, and the references in it (seen by nobody) are released in their sessions.
    * **`cancel_grace`.** A cancelled call still running `cancel_grace` ms later did not
      stop when interrupted: it is stuck in C code (interrupted only once it returns to
      Python), in an `__enter__` (never interrupted), or it caught the interruption. The
      Python process is then killed and the worker restarts; every call in flight on it,
      and every session lost with it, says why (which request, and `cancel_grace`). As
      with Ctrl-C, an interruption that lands in the interrupted code's own cleanup can
      leave that code's state half-reset; the worker's own state is never interrupted.
    * **Logs.** `log` frames go to `Logger` with the Python logger's name.

  Start options: `:python`, `:worker_module`, `:allow`, `:max_refs`, `:poll_us`,
  `:max_frame_bytes`, `:env` (see `VllmBridge.Worker.Launcher.open/1`), `:start_timeout`
  (ms, default 60 000), `:cancel_grace` (ms, default 5 000), `:shutdown_grace` (ms the
  Python process is given to exit on EOF before it is killed, default 3 000), and, in a
  pool, `:pool`, `:index` and `:meta`.
  """
  use GenServer, restart: :permanent

  require Logger

  alias VllmBridge.Error
  alias VllmBridge.Call.{Request, Wire}
  alias VllmBridge.Pool.{Directory, Slots}
  alias VllmBridge.Worker.{Calls, Framer, Launcher, PythonLog}

  @start_timeout 60_000
  @cancel_grace 5_000
  @shutdown_grace 3_000
  @sweep_every 1_000

  @typedoc "What the worker announced in its handshake."
  @type hello :: %{optional(String.t()) => term()}

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
  Waits until the handshake is done: `{:ok, hello}`, or the reason the worker could not
  start (a `VllmBridge.Error`).
  """
  @spec await_ready(GenServer.server(), timeout()) :: {:ok, hello()} | {:error, Error.t()}
  def await_ready(worker, timeout \\ @start_timeout + 5_000) do
    {:ok, GenServer.call(worker, :hello, timeout)}
  catch
    :exit, {{:shutdown, {:start_failed, %Error{} = e}}, _} ->
      {:error, e}

    :exit, {reason, _} ->
      {:error, Error.new(:worker_exit, "worker start failed: #{inspect(reason)}")}
  end

  @doc "The handshake the Python process announced (waits for it)."
  @spec hello(GenServer.server()) :: hello()
  def hello(worker), do: GenServer.call(worker, :hello, :infinity)

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
    deadline = VllmBridge.Call.Runtime.deadline(System.monotonic_time(:millisecond), timeout)

    with {:ok, parts} <- Wire.encode_invoke({module, name}, args, kwargs) do
      req = Request.new("call", [Wire.value(nil)], true, parts, {module, name})
      Request.call(pid, req, deadline, false)
    end
  end

  @doc """
  Sends `ping` and returns the worker's status map (`"running"`, `"queued"`,
  `"sessions"`, `"refs"`); answered by the worker's reader thread even while a call runs.
  """
  @spec ping(GenServer.server(), timeout()) :: {:ok, map()} | {:error, Error.t()}
  def ping(worker, timeout \\ 5_000) do
    deadline = VllmBridge.Call.Runtime.deadline(System.monotonic_time(:millisecond), timeout)
    Request.call(GenServer.whereis(worker), Request.new("ping", [], false, []), deadline, false)
  end

  @doc "Closes the port; the Python process sees EOF and exits. The worker stops."
  @spec close(GenServer.server()) :: :ok
  def close(worker), do: GenServer.call(worker, :close, :infinity)

  @doc "How many calls this worker has in flight (its table), for tests and diagnostics."
  @spec in_flight(GenServer.server()) :: non_neg_integer()
  def in_flight(worker), do: GenServer.call(worker, :in_flight)

  # -- server ---------------------------------------------------------------------------

  @impl true
  def init(opts) do
    pool = Keyword.get(opts, :pool)
    index = Keyword.get(opts, :index, 0)
    meta = Keyword.get(opts, :meta)

    # The port's failure comes as a message (its callers are then told why), and
    # shutting down runs terminate/2 (callers told, Python process gone): when a pool's
    # supervisor stops this process, and when a standalone worker's owner (the process
    # that started it, linked) exits, whatever its reason.
    Process.flag(:trap_exit, true)

    if meta do
      Slots.put_load(meta, index, Slots.down())
      Directory.clear_worker(pool, index)
    end

    case Launcher.open(opts) do
      {:ok, port} ->
        state = %{
          port: port,
          launch: Keyword.take(opts, [:max_frame_bytes]),
          framer: nil,
          max_frame: min(Launcher.max_frame_bytes(opts), Wire.max_body_size()),
          os_pid: Launcher.os_pid(port),
          hello: nil,
          instance: nil,
          pool: pool,
          index: index,
          meta: meta,
          calls: Calls.new(meta, index),
          # Why the Python process was killed, once this process killed it (cancel_grace).
          killed: nil,
          start_timeout: Keyword.get(opts, :start_timeout, @start_timeout),
          cancel_grace: Keyword.get(opts, :cancel_grace, @cancel_grace),
          shutdown_grace: Keyword.get(opts, :shutdown_grace, @shutdown_grace)
        }

        {:ok, state, {:continue, :handshake}}

      {:error, e} ->
        {:stop, {:shutdown, {:start_failed, e}}}
    end
  end

  @impl true
  def handle_continue(:handshake, state) do
    case Launcher.handshake_settling(state.port, state.start_timeout, state.launch) do
      {:ok, hello, settled, {framer, frames}} ->
        state = %{
          state
          | hello: hello,
            instance: hello["instance"],
            os_pid: hello["pid"],
            calls: Calls.settled(state.calls, settled),
            framer: framer
        }

        if state.meta do
          Directory.worker_up(state.pool, state.index, self(), state.instance)
          Slots.put_load(state.meta, state.index, 0)
          Slots.kick(state.meta)
        end

        Process.send_after(self(), :sweep, @sweep_every)
        # Frames that came with the hello (a log record, say), as if they came after it.
        {:noreply, Enum.reduce(frames, state, &route(&2, &1))}

      {:error, e} ->
        Logger.error("vllm_bridge worker #{label(state)} failed to start: #{e.message}")
        {:stop, {:shutdown, {:start_failed, e}}, %{state | port: nil}}
    end
  end

  @impl true
  def handle_call(:hello, _from, state), do: {:reply, state.hello, state}
  def handle_call(:in_flight, _from, state), do: {:reply, Calls.size(state.calls), state}

  def handle_call(:close, _from, state) do
    {:stop, :normal, :ok, shut(state, "the worker was closed")}
  end

  @impl true
  def handle_info({port, {:data, data}}, %{port: port} = state) do
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

  # A request from a caller (VllmBridge.Call.Request): written to the port and put in the
  # table of calls in flight (VllmBridge.Worker.Calls), unless the table refuses it.
  def handle_info({:"$vb_req", id, alias, caller, frame, size, deadline, counted, what}, state) do
    # (A body too long to be framed, frame nil, is over any limit: `max_frame` is capped
    # at what a frame's length can say.)
    case Calls.admit(state.calls, id, alias, counted, size, state.max_frame) do
      {:ok, calls} ->
        Port.command(state.port, frame)
        calls = Calls.add(calls, id, alias, caller, counted, what, deadline)
        {:noreply, %{state | calls: calls}}

      {:refused, calls} ->
        {:noreply, %{state | calls: calls}}
    end
  end

  def handle_info({:"$vb_cancel", id}, state), do: {:noreply, cancel(state, id)}

  # A stream's consumer gives room back (VllmBridge.Stream): passed on while it is live.
  def handle_info({:"$vb_credit", id, n}, state) do
    if Calls.live(state.calls, id),
      do: Port.command(state.port, Wire.request("credit", id, [Wire.value(n)]))

    {:noreply, state}
  end

  # A caller gives up (VllmBridge.Call.Request.give_up/2, or a stream that stops): cancel as
  # above, then answer, always. A reply already passed on reaches the caller first.
  def handle_info({:"$vb_settle", id, alias}, state) do
    state = cancel(state, id)
    send(alias, {alias, :cancelled, nil})
    {:noreply, state}
  end

  def handle_info({:"$vb_grace", id}, state) do
    case Calls.overstayed(state.calls, id, state.cancel_grace) do
      nil ->
        {:noreply, state}

      overstayed ->
        why = "the Python process (os pid #{state.os_pid}) was killed because #{overstayed}"
        Logger.warning("vllm_bridge worker #{label(state)}: #{why}; the worker restarts")
        Launcher.kill(state.os_pid)
        # Every call that loses its worker, and every session lost with it, says why.
        {:noreply, %{state | killed: why}}
    end
  end

  # The caller of a call died: cancel the call as if it had timed out.
  def handle_info({:DOWN, mon, :process, _caller, _reason}, state) do
    case Calls.abandoned(state.calls, mon) do
      nil -> {:noreply, state}
      id -> {:noreply, cancel(state, id)}
    end
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

  def handle_info(_other, state), do: {:noreply, state}

  @impl true
  def terminate(_reason, state) do
    shut(state, "the worker is shutting down")
    :ok
  end

  # -- frames from the worker --------------------------------------------------------------

  # One whole frame: a reply or chunk goes to its caller as it is (the caller decodes it).
  defp route(state, bin) do
    case Wire.peek(bin) do
      {kind, id} when kind in [:ok, :error, :pong] and id != nil ->
        %{state | calls: Calls.finish(state.calls, id, :reply, bin)}

      {:chunk, id} when id != nil ->
        case Calls.live(state.calls, id) do
          nil -> Calls.drop(bin)
          alias -> send(alias, {alias, :chunk, bin})
        end

        state

      {:end, id} when id != nil ->
        %{state | calls: Calls.finish(state.calls, id, :end, nil)}

      {:log, _} ->
        PythonLog.emit(bin, label(state))
        state

      other ->
        Logger.warning(
          "vllm_bridge worker #{label(state)}: frame without a call to answer " <>
            "(#{inspect(other)}): #{inspect(VllmBridge.Codec.decode(bin), limit: 12)}"
        )

        state
    end
  end

  # The caller gave up, died, or its call is overdue: cancel it (Python drops it if
  # queued, interrupts it if running), and restart the Python process if the call still
  # runs `cancel_grace` ms from now.
  defp cancel(state, id) do
    case Calls.cancel(state.calls, id, System.monotonic_time(:millisecond)) do
      {:cancelled, calls} ->
        Port.command(state.port, Wire.request("cancel", id, []))
        Process.send_after(self(), {:"$vb_grace", id}, state.cancel_grace)
        %{state | calls: calls}

      :not_live ->
        state
    end
  end

  # The directory forgets this worker (keeping why) and its slots go down; only then
  # does everything in flight get :worker_exit, so that a caller that retries at once
  # finds it gone (its session lost, saying why) instead of reserving on it. The Python
  # process is closed (and killed if it lingers). Requests still in this mailbox see the
  # stop reason, `{:shutdown, {:worker_exit, message}}` (VllmBridge.Call.Request.worker_down/1).
  defp shut(state, message) do
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
        "in flight get :worker_exit and the worker restarts"
    )

    why = state.killed || event
    {:stop, {:shutdown, {:worker_exit, why}}, shut(state, why)}
  end

  defp label(%{pool: nil, os_pid: os_pid}), do: "(os pid #{os_pid})"
  defp label(%{pool: pool, index: index}), do: "#{inspect(pool)}[#{index}]"
end
