defmodule VllmBridge.Remote.Proxy do
  @moduledoc false
  # The far end of a request from another node (VllmBridge.Remote): spawned on this node
  # by the caller there, it runs the request as an ordinary local caller would.
  #
  # Two processes, because the one that waits for the worker cannot also watch the caller:
  #
  #   * the runner (start/3, the process the caller spawned and monitors) makes the
  #     request (VllmBridge.Call.Run, VllmBridge.Stream) and sends what comes back to the
  #     caller's alias, with this node set on its references (VllmBridge.Remote.stamp/2).
  #     The caller monitors the runner itself, not a go-between: a process's signals to
  #     another keep their order, so its DOWN never overtakes its last answer (which a
  #     large answer, sent in fragments, otherwise could). References it gets outside a
  #     session belong to the caller (VllmBridge.Session.LooseRefs.act_for/1): released
  #     when the caller exits. When the caller gives up on it, the caller kills it, and
  #     the worker sees its caller go and cancels the request;
  #   * the watcher monitors the caller and the runner. When the caller goes (it exited,
  #     was shut down, or its node went: `:noconnection`) it kills the runner, so the
  #     worker sees its caller go and cancels the request, exactly as for a local caller
  #     that dies. It ends with the runner. A stream's `:halt` comes to it: it passes it
  #     on to the runner, and kills a runner that has not halted @halt_grace later (one
  #     waiting for a slow generator's next chunk).
  #
  # Answers to the caller, on its alias `reply`: `{reply, :result, result}` for a request;
  # for a stream `{reply, :watcher, pid}` first, then `{reply, :chunk, value}`..., then
  # `{reply, :end}`, `{reply, :error, e}` or, after a `:halt`, `{reply, :halted}`. The
  # caller sends a stream's `{:credit, n}` to the runner.

  alias VllmBridge.{Error, Remote, Session}
  alias VllmBridge.Call.{Run, Runtime}
  alias VllmBridge.Session.LooseRefs

  # How long a runner told to halt its stream has to do so between two chunks.
  @halt_grace 1_000

  @doc false
  @spec start(pid(), reference(), tuple()) :: term()
  def start(caller, reply, job) do
    runner = self()
    watcher = spawn(fn -> watch(caller, runner) end)
    run(caller, reply, watcher, job)
  end

  defp watch(caller, runner) do
    watch(Process.monitor(caller), Process.monitor(runner), runner)
  end

  defp watch(caller_mon, runner_mon, runner) do
    receive do
      {:DOWN, ^runner_mon, :process, _, _} ->
        :ok

      {:DOWN, ^caller_mon, :process, _, _} ->
        Process.exit(runner, :kill)

      :halt ->
        send(runner, :halt)
        Process.send_after(self(), :kill_runner, @halt_grace)
        watch(caller_mon, runner_mon, runner)

      :kill_runner ->
        Process.exit(runner, :kill)

      _other ->
        watch(caller_mon, runner_mon, runner)
    end
  end

  defp run(caller, reply, _watcher, {:run, rt, left, kind, parts, opts}) do
    LooseRefs.act_for(caller)
    now = System.monotonic_time(:millisecond)
    rt = %{rt | deadline: Runtime.deadline(now, left), node: node()}
    result = rt |> Run.run(kind, parts, opts) |> stamp()
    send(reply, {reply, :result, result})
  end

  defp run(caller, reply, watcher, {:stream, target, args, kwargs, opts, current}) do
    LooseRefs.act_for(caller)
    send(reply, {reply, :watcher, watcher})

    in_session(current, fn ->
      case VllmBridge.Stream.new(target, args, kwargs, opts) do
        {:ok, stream} ->
          forward(reply, fn -> Enumerable.reduce(stream, {:cont, nil}, &suspend/2) end)

        {:error, e} ->
          send(reply, {reply, :error, e})
      end
    end)
  end

  # The caller's current session (VllmBridge.Session.current/0) is this process's while
  # the stream runs, so that the stream resolves its session as it would have there.
  defp in_session(nil, fun), do: fun.()

  defp in_session(id, fun) do
    case Session.lookup(id) do
      {:ok, s} -> Session.with_current(s, fun)
      {:error, _} -> fun.()
    end
  end

  defp suspend(chunk, _acc), do: {:suspend, chunk}

  # Reads the local stream one chunk at a time and sends each to the caller, at most a
  # window (VllmBridge.Stream.window/0) ahead of what the caller has read: the caller
  # gives room back as a local reader gives it to a worker, half a window at a time.
  defp forward(reply, first) do
    step(reply, first, 0, VllmBridge.Stream.window())
  rescue
    e in Error -> send(reply, {reply, :error, e})
  end

  defp step(reply, next, ahead, window) do
    case next.() do
      {:suspended, chunk, cont} ->
        send(reply, {reply, :chunk, stamp(chunk)})

        case room(ahead + 1, window) do
          {:ok, ahead} ->
            step(reply, fn -> cont.({:cont, nil}) end, ahead, window)

          :halt ->
            cont.({:halt, nil})
            send(reply, {reply, :halted})
        end

      # The stream's end (Stream.resource answers a reducer that suspends with
      # :halted at its end, not :done).
      {ended, _} when ended in [:done, :halted] ->
        send(reply, {reply, :end})
    end
  end

  # Credits that came in, and a halt; waits for credit while a window is out.
  defp room(ahead, window) do
    receive do
      {:credit, n} -> room(ahead - n, window)
      :halt -> :halt
    after
      0 ->
        if ahead >= window do
          receive do
            {:credit, n} -> room(ahead - n, window)
            :halt -> :halt
          end
        else
          {:ok, ahead}
        end
    end
  end

  defp stamp({:ok, value}), do: {:ok, Remote.stamp(value, node())}
  defp stamp({:error, _} = error), do: error
  defp stamp(value), do: Remote.stamp(value, node())
end
