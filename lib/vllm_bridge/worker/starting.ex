defmodule VllmBridge.Worker.Starting do
  @moduledoc false
  # The first phase of a worker process (VllmBridge.Worker): its port is open and the
  # Python process must send its hello within `start_timeout`. The handshake is a state
  # of the worker process, not a wait inside it: requests that arrive meanwhile are kept
  # in the state, in order, and so are the callers of `hello` and `close`; a caller that
  # gives up meanwhile has its request dropped here and is answered at once. The hello
  # (checked by VllmBridge.Worker.Hello) makes the worker :ready, and what waited is
  # served; a start that fails stops the process with `{:shutdown, {:start_failed,
  # error}}` (what VllmBridge.Worker.await_ready/2 returns).

  require Logger
  require VllmBridge.Worker.Messages

  alias VllmBridge.Error
  alias VllmBridge.Pool.{Directory, Slots}
  alias VllmBridge.Worker
  alias VllmBridge.Call.Wire
  alias VllmBridge.Worker.{Calls, Framer, Hello, Launcher, Messages}

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

    if meta do
      Slots.put_load(meta, index, Slots.down())
      Directory.clear_worker(pool, index)
    end

    case Launcher.open(opts) do
      {:ok, port} ->
        start_timeout = Keyword.fetch!(opts, :start_timeout)
        Process.send_after(self(), Messages.start_timeout(), start_timeout)

        state = %{
          phase: :starting,
          port: port,
          framer: Framer.new(),
          max_frame: min(Launcher.max_frame_bytes(opts), Wire.max_body_size()),
          os_pid: Launcher.os_pid(port),
          hello: nil,
          instance: nil,
          # Chunks a stream may run ahead of its reader: the hello's.
          stream_window: nil,
          pool: pool,
          index: index,
          meta: meta,
          calls: Calls.new(meta, index),
          # While starting: the requests that came (newest first) and the callers of
          # hello/1 and close/1 (newest first), served once the hello has come.
          pending: [],
          waiting: [],
          # Why the Python process was killed, once this process killed it (cancel_grace).
          killed: nil,
          start_timeout: start_timeout,
          cancel_grace: Keyword.fetch!(opts, :cancel_grace),
          shutdown_grace: Keyword.fetch!(opts, :shutdown_grace)
        }

        {:ok, state}

      {:error, e} ->
        {:stop, {:shutdown, {:start_failed, e}}}
    end
  end

  # While starting, the phase's own module answers (VllmBridge.Worker.Starting).
  @spec handle_call(term(), GenServer.from(), map()) :: tuple()
  def handle_call(request, from, state)
      when request in [:hello, :close],
      do: {:noreply, %{state | waiting: [{from, request} | state.waiting]}}

  def handle_call(:in_flight, _from, state), do: {:reply, Calls.size(state.calls), state}

  @spec handle_info(term(), map()) :: tuple()
  def handle_info({port, {:data, data}}, %{port: port} = state) do
    case Framer.feed(state.framer, data, state.max_frame) do
      {:ok, [], framer} ->
        {:noreply, %{state | framer: framer}}

      {:ok, [hello | frames], framer} ->
        case Hello.check(hello, state.max_frame) do
          {:ok, hello} -> ready(%{state | framer: framer}, hello, frames)
          {:error, e} -> start_failed(state, e)
        end

      {:too_large, len, _frames} ->
        start_failed(
          state,
          Error.new(:protocol, Launcher.too_large_message(state.os_pid, len, state.max_frame))
        )
    end
  end

  def handle_info({port, {:exit_status, status}}, %{port: port} = state),
    do: start_failed(%{state | port: nil}, Hello.exited(status))

  def handle_info(Messages.start_timeout(), state),
    do: start_failed(state, Hello.timed_out(state.os_pid, state.start_timeout))

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

  # Anything else (the port's own EXIT follows its exit status) waits for the hello.
  def handle_info(_other, state), do: {:noreply, state}

  # The hello came: registered (in a pool) and open for calls; what waited is served in
  # the order it came, the frames that came with the hello (a log record, say) first, as
  # if they had come after it.
  defp ready(state, hello, frames) do
    state = %{
      state
      | phase: :ready,
        hello: hello,
        instance: hello["instance"],
        os_pid: hello["pid"],
        stream_window: Hello.stream_window(hello)
    }

    if state.meta do
      Directory.worker_up(state.pool, state.index, self(), state.instance)
      Slots.put_load(state.meta, state.index, 0)
      Slots.kick(state.meta)
    end

    Process.send_after(self(), :sweep, Worker.sweep_every())
    state = Enum.reduce(frames, state, &Worker.route(&2, &1))

    state =
      state.pending
      |> Enum.reverse()
      |> Enum.reduce(%{state | pending: []}, &Worker.submit(&2, &1))

    waiting = Enum.reverse(state.waiting)
    state = %{state | waiting: []}
    for {from, :hello} <- waiting, do: GenServer.reply(from, hello)

    case for {from, :close} <- waiting, do: from do
      [] ->
        {:noreply, state}

      closers ->
        state = Worker.shut(state, "the worker was closed")
        for from <- closers, do: GenServer.reply(from, :ok)
        {:stop, :normal, state}
    end
  end

  defp start_failed(state, %Error{} = e) do
    Logger.error("vllm_bridge worker #{Worker.label(state)} failed to start: #{e.message}")
    # A Python process that is still there is closed (and killed at once).
    if state.port, do: Launcher.close(state.port, state.os_pid, 0)
    {:stop, {:shutdown, {:start_failed, e}}, %{state | port: nil}}
  end
end
