defmodule VllmBridge.Worker.StartFailure do
  @moduledoc false
  # A worker's start that failed (VllmBridge.Worker.Starting, whose comment says when):
  # logged once, with the Python traceback when there is one; the :failed progress stage
  # and the :exit event; the Python process closed and killed at once. Then a worker of a
  # pool that VllmBridge.Pool.start/2 is still starting stays in the phase :failed,
  # answering with the error until start/2 stops the pool; any other stops with
  # `{:shutdown, {:start_failed, error}}`.

  require Logger
  require VllmBridge.Worker.Messages

  alias VllmBridge.Error
  alias VllmBridge.Worker
  alias VllmBridge.Worker.{Calls, Events, Launcher, Messages, Progress}

  defp who(%{pool: nil, os_pid: os_pid}), do: "the worker (os pid #{os_pid})"
  defp who(%{index: index, os_pid: os_pid}), do: "worker #{index} (os pid #{os_pid})"

  # The Python process of a failed start is killed at once (no grace, no warning: the
  # start's error says what happened), and gone when this returns.
  @doc false
  @spec kill(map()) :: map()
  def kill(%{port: nil} = state), do: state

  def kill(state) do
    try do
      Port.close(state.port)
    rescue
      ArgumentError -> :ok
    end

    Launcher.kill(state.procs)

    %{state | port: nil}
  end

  @doc false
  # The start failed with `e`: logged once, reported, the Python process gone; then the
  # phase :failed (a pool's first start) or the process stops.
  @spec start_failed(map(), Error.t()) :: tuple()
  def start_failed(state, %Error{} = e) do
    e = %{e | message: "#{who(state)}: #{e.message}"}
    state = Progress.report(state, :failed, %{error: e})
    # The one log of a failed start: with the Python traceback when there is one (an
    # on_start that raised), readable, since the error itself travels as a term.
    Logger.error(
      "vllm_bridge worker #{Worker.label(state)} failed to start: #{e.message}" <>
        if(is_binary(e.traceback) and e.traceback != "", do: "\n" <> e.traceback, else: ""),
      VllmBridge.Worker.LogMeta.of(state)
    )

    Events.exited(state, e.message, length(state.pending))

    # A Python process that is still there is closed (and killed at once).
    state = kill(state)
    Launcher.delete_stderr(state.stderr)
    if state.setup, do: :erlang.unalias(state.setup)
    state = %{state | stderr: nil, setup: nil}

    if first_start?(state) do
      hold_failure(state, e)
    else
      {:stop, {:shutdown, {:start_failed, e}}, state}
    end
  end

  # Whether VllmBridge.Pool.start/2 still waits for this pool's first start.
  defp first_start?(%{meta: %{started: started}}) when started != nil,
    do: :atomics.get(started, 1) == 0

  defp first_start?(_state), do: false

  # The phase :failed: the error for whoever waits or asks, until the pool is stopped.
  defp hold_failure(state, e) do
    for s <- Enum.reverse(state.pending), do: refuse(state, s, e)

    waiting = Enum.reverse(state.waiting)
    for {from, :await_ready} <- waiting, do: GenServer.reply(from, {:error, e})
    closers = for {from, :close} <- waiting, do: from

    state = %{state | phase: :failed, failed: e, pending: [], waiting: []}

    case closers do
      [] ->
        {:noreply, state}

      _ ->
        for from <- closers, do: GenServer.reply(from, :ok)
        {:stop, :normal, state}
    end
  end

  @doc false
  # A message in the phase :failed.
  @spec info(term(), map()) :: tuple()
  def info(Messages.submit(s), state) do
    refuse(state, s, state.failed)
    {:noreply, state}
  end

  def info(Messages.settle(_id, alias), state) do
    Messages.send_cancelled(alias)
    {:noreply, state}
  end

  def info(_other, state), do: {:noreply, state}

  defp refuse(state, s, e) do
    if s.alias, do: Messages.send_reply_error(s.alias, e)
    if s.holds_slot, do: Calls.release(state.calls)
  end
end
