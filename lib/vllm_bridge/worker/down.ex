defmodule VllmBridge.Worker.Down do
  @moduledoc false
  # The end of a ready worker process (VllmBridge.Worker): why it goes down, and what it
  # leaves behind. Apart from VllmBridge.Worker because it runs once per worker, never on
  # a call's path; the worker's callbacks hand the events that end it here.
  #
  #   * **Death.** When the Python process exits, or the port to it fails (it stopped
  #     reading: `:epipe`), or the reader of its stdout and stderr stops, every call in
  #     flight gets `{:error, %VllmBridge.Error{type: :worker_exit}}` saying so at once and
  #     the worker process stops; its supervisor starts a new one (a new Python process, a
  #     new `instance`). When the Python process was killed for a call that overstayed its
  #     cancel (VllmBridge.Worker.Cancel), that reason is what every caller is told.
  #   * **Frame size.** A header from the Python process declaring more than
  #     `:max_frame_bytes` means the stream cannot be trusted: the Python process is
  #     killed, every call in flight gets `:worker_exit` naming the length and the limit,
  #     and the worker process stops.
  #   * **Shut.** Closed, stopped or gone down, the worker is forgotten by its pool first
  #     and only then are its callers answered (`shut/2`).

  require Logger

  alias VllmBridge.Pool.{Directory, Slots}
  alias VllmBridge.Worker
  alias VllmBridge.Worker.{Calls, Events, Launcher, OsProcess}

  @doc false
  # The Python process exited (the port's exit status).
  @spec exited(map(), integer()) :: {:stop, term(), map()}
  def exited(state, status) do
    down(
      %{state | port: nil},
      "the Python worker exited with status #{status} (os pid #{state.os_pid})"
    )
  end

  @doc false
  # The port failed (`:epipe`: a write the Python process no longer reads, because it
  # stopped reading or is on its way out): no frame can reach it any more.
  @spec port_failed(map(), term()) :: {:stop, term(), map()}
  def port_failed(state, reason) do
    down(
      state,
      "the port to the Python process (os pid #{state.os_pid}) failed " <>
        "(#{inspect(reason)}): it no longer reads its requests (see its stderr)"
    )
  end

  @doc false
  # The process that reads the Python process's stdout and stderr is gone: what the
  # Python process writes there would fail (a broken pipe), so it starts again.
  @spec output_stopped(map(), term()) :: {:stop, term(), map()}
  def output_stopped(state, reason) do
    down(
      %{state | output: nil},
      "the reader of its stdout and stderr stopped (#{inspect(reason)})"
    )
  end

  @doc false
  # A frame header declared `len` bytes, over the limit: the Python process is killed
  # first (it must not go on writing into a stream nobody reads), then the worker goes
  # down.
  @spec too_large(map(), non_neg_integer()) :: {:stop, term(), map()}
  def too_large(state, len) do
    OsProcess.kill_worker(state.procs)
    down(state, Launcher.too_large_message(state.os_pid, len, state.max_frame))
  end

  # The worker goes down: logged, every caller told why (the grace kill's reason, when
  # that is what ended it), and this process stops (its supervisor starts a new one).
  defp down(state, event) do
    Logger.error(
      "vllm_bridge worker #{Worker.label(state)}: #{event}; #{Calls.size(state.calls)} " <>
        "call(s) in flight get :worker_exit and the worker restarts",
      VllmBridge.Worker.LogMeta.of(state)
    )

    why = state.killed || event
    Events.exited(state, why, Calls.size(state.calls))
    {:stop, {:shutdown, {:worker_exit, why}}, shut(state, why)}
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

    if state.port,
      do: Launcher.close(state.port, state.procs, state.shutdown_grace)

    # Down once: terminate/2 runs this again, and must not overwrite the reason recorded.
    %{state | calls: calls, port: nil, instance: nil}
  end
end
