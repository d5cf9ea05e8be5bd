defmodule VllmBridge.Remote.Proxy do
  @moduledoc false
  # The far end of a request from another node (VllmBridge.Remote): spawned on this node
  # by the caller there, it runs the request as an ordinary local caller would.
  #
  # Two processes, because the one that waits for the worker cannot also watch the caller:
  #
  #   * the runner (start/4, the process the caller spawned and monitors) waits for the
  #     caller's go (below), then makes the request (VllmBridge.Call.Run,
  #     VllmBridge.Stream) and sends what comes back to the caller's alias (its
  #     references name this node: they are decoded here).
  #     The caller monitors the runner itself, not a go-between: a process's signals to
  #     another keep their order, so its DOWN never overtakes its last answer (which a
  #     large answer, sent in fragments, otherwise could). References it gets outside a
  #     session belong to the caller (VllmBridge.Session.LooseRefs.act_for/1): released
  #     when the caller exits. When the caller gives up on it, the caller kills it, and
  #     the worker sees its caller go and cancels the request;
  #   * the watcher monitors the caller and the runner. When the caller goes (it exited,
  #     was shut down, or its node went: `:noconnection`) it kills the runner (a stream's
  #     runner is told to halt first, so that it settles the chunks it got from its
  #     worker), so the worker sees its caller go and cancels the request, exactly as for
  #     a local caller that dies. For a stream it also keeps the references of the chunks
  #     sent that the caller has not given credit for (the credit passes through it), at
  #     most a window of them: when the caller halts, saying how many chunks it read, the
  #     watcher passes the halt on to the runner, kills a runner that has not halted
  #     @halt_grace later (one waiting for a slow generator's next chunk), and releases
  #     the references of the chunks past those the caller read (on their way, or unread
  #     in its mailbox, which it drops). So the caller never waits on this node to halt,
  #     and keeps exactly the references of the chunks it read, as a local reader does.
  #
  # The go: the runner submits nothing before `{:go, reply}` comes from the caller, which
  # sends it on the runner's spawn reply if its own give-up time has not passed. A spawn
  # request delivered after the caller gave up (this node was stopped, or the connection
  # stalled, and ran again before the connection was given up) finds no go coming: its
  # runner exits `:not_started` after the wait it was given, having run nothing. The
  # price is a message round trip between the two nodes before each remote request
  # starts (bench/remote_call.exs).
  #
  # Answers to the caller, on its alias `reply`: `{reply, :result, result}` for a request;
  # for a stream `{reply, :watcher, pid}` first, then `{reply, :chunk, value}`..., then
  # `{reply, :end}`, `{reply, :error, e}` or, after a `:halt`, `{reply, :halted}`. The
  # caller sends a stream's `{:credit, n}` to the watcher, then `:done` (it read the
  # end or the error) or `{:halt, read, grace}` (`grace` the ms the runner has to halt,
  # or `:now`); when it halts before the watcher's pid came, it kills the runner instead
  # (it has read nothing).

  alias VllmBridge.{Error, Ref, Session}
  alias VllmBridge.Call.{Run, Runtime}
  alias VllmBridge.Session.LooseRefs

  # How long a runner told to halt its stream has to do so between two chunks.
  @halt_grace 1_000

  # The exit reason of a runner that never got its go: it submitted nothing
  # (VllmBridge.Remote.down/4 knows it).
  @unwanted :not_started

  @doc false
  @spec start(pid(), reference(), timeout(), tuple()) :: term()
  def start(caller, reply, wait, job) do
    # The request's milliseconds left count from here, not from the go: the go's trip
    # back and forth between the nodes (and a busy node's delay) comes out of them, so
    # the request ends at its caller's deadline, as it would on the caller's node.
    started = System.monotonic_time(:millisecond)
    runner = self()
    stream? = elem(job, 0) == :stream
    # Spawned before the go comes, so that a caller that dies (or whose node goes) while
    # this process waits for it is seen: the watcher then kills this process.
    watcher = spawn(fn -> watch(caller, runner, stream?) end)

    # Nothing is submitted before the caller says go, which it says only on this
    # process's spawn reply and only while it still waits (VllmBridge.Remote.spawn_proxy/3):
    # a spawn request that reached this node after the caller gave up on it (this node
    # was stopped, or the connection stalled) starts nothing. `wait` is the caller's
    # give-up time as it stood when it sent the request; counted here from this
    # process's start, which came after the send, it ends after the caller's give-up
    # whatever the two nodes' clocks read (only their rates matter), so a go sent in time
    # is not refused for lack of patience, and one that cannot come any more is not
    # waited for.
    receive do
      {:go, ^reply} -> run(caller, reply, watcher, job, started)
    after
      wait -> exit(@unwanted)
    end
  end

  defp watch(caller, runner, stream?) do
    watch(%{
      caller: Process.monitor(caller),
      runner_mon: Process.monitor(runner),
      runner: runner,
      stream?: stream?,
      # A stream's ledger: the references of each chunk sent that the caller has not
      # given credit for yet (chunk number => refs), at most a window of them.
      sent: %{},
      credited: 0,
      # How many chunks the caller read, once it halted.
      read: nil
    })
  end

  defp watch(w) do
    %{caller: caller_mon, runner_mon: runner_mon} = w

    receive do
      {:DOWN, ^caller_mon, :process, _, _} when w.runner == nil ->
        # Its stream had ended: what the caller owned goes with it (LooseRefs).
        :ok

      {:DOWN, ^caller_mon, :process, _, _} when not w.stream? ->
        Process.exit(w.runner, :kill)

      {:DOWN, ^caller_mon, :process, _, _} ->
        # A stream halts between two chunks, which settles the chunks the runner got
        # from its worker and had not read (killed, it would take their references
        # with it); killed if it has not a grace later.
        send(w.runner, :halt)
        Process.send_after(self(), :kill_runner, @halt_grace)
        watch(%{w | caller: nil})

      {:DOWN, ^runner_mon, :process, _, reason} ->
        w = %{w | runner: nil}

        cond do
          not w.stream? -> :ok
          # It never got its go: it sent nothing, and its caller no longer waits for it.
          reason == @unwanted -> :ok
          w.read != nil -> release_unread(w)
          # The caller is gone: what it owned goes with it (LooseRefs).
          w.caller == nil -> :ok
          # Killed by the caller before it knew this process: it read nothing.
          reason == :killed -> release_unread(%{w | read: w.credited})
          # Its stream ended: the caller reads what is left, then says :done or halts.
          true -> watch(w)
        end

      {:sent, i, refs} ->
        watch(%{w | sent: Map.put(w.sent, i, refs)})

      {:credit, n} ->
        if w.runner, do: send(w.runner, {:credit, n})
        credited = w.credited + n
        watch(%{w | credited: credited, sent: Map.reject(w.sent, fn {i, _} -> i <= credited end)})

      {:halt, read, grace} ->
        w = %{w | read: read}

        cond do
          w.runner == nil ->
            release_unread(w)

          grace == :now ->
            Process.exit(w.runner, :kill)
            watch(w)

          true ->
            send(w.runner, :halt)
            Process.send_after(self(), :kill_runner, grace)
            watch(w)
        end

      :done ->
        :ok

      :kill_runner ->
        if w.runner, do: Process.exit(w.runner, :kill)
        watch(w)

      _other ->
        watch(w)
    end
  end

  # The references of the chunks sent past what the caller read (on their way, or unread
  # in its mailbox, which it drops): released here, in their session, so that the caller
  # never waits on this node to halt.
  defp release_unread(%{sent: sent, read: read}) do
    case for({i, refs} <- sent, i > read, do: refs) |> List.flatten() do
      [] -> :ok
      refs -> _ = VllmBridge.release(refs, session_id: nil, timeout: 60_000)
    end

    :ok
  end

  @doc "How long a runner told to halt its stream has to do so between two chunks, in ms."
  @spec halt_grace() :: non_neg_integer()
  def halt_grace, do: @halt_grace

  defp run(caller, reply, _watcher, {:run, rt, left, kind, parts, opts}, started) do
    LooseRefs.act_for(caller)
    rt = %{rt | deadline: Runtime.deadline(started, left), node: node()}
    refs = List.wrap(opts[:bound]) ++ List.wrap(opts[:payload])

    # (A reference's request runs in its own session unless one was named.)
    named = if opts[:bound] && rt.session_current?, do: nil, else: rt.session_id

    result =
      case lost(caller, named, refs) do
        nil -> Run.run(rt, kind, parts, opts)
        e -> {:error, e}
      end

    send(reply, {reply, :result, result})
  end

  # A stream's whole time (`stream_timeout`, what was left of its deadline when its
  # caller sent it) loses what passed here before the go, as a request's does. (Its
  # `timeout`, the most each chunk may take, is not cut: it is every chunk's, not a
  # budget. A late go so leaves the first chunk its whole `timeout` from the go; the
  # caller's wait for that chunk, counted from its send, ends first: VllmBridge.Remote.Stream.)
  defp run(caller, reply, watcher, {:stream, target, args, kwargs, opts, current}, started) do
    LooseRefs.act_for(caller)

    opts =
      case Keyword.fetch(opts, :stream_timeout) do
        {:ok, left} -> Keyword.put(opts, :stream_timeout, after_go(left, started))
        :error -> opts
      end

    send(reply, {reply, :watcher, watcher})

    named =
      case opts[:session_id] do
        %Session{id: id} -> id
        id -> id
      end

    case lost(caller, named || current, Ref.collect({target, args, kwargs})) do
      nil -> stream(reply, watcher, {target, args, kwargs, opts, current})
      e -> send(reply, {reply, :error, e})
    end
  end

  defp after_go(:infinity, _started), do: :infinity

  defp after_go(left, started),
    do: max(left - (System.monotonic_time(:millisecond) - started), 0)

  defp stream(reply, watcher, {target, args, kwargs, opts, current}) do
    in_session(current, fn ->
      case VllmBridge.Stream.new(target, args, kwargs, opts) do
        {:ok, stream} ->
          forward(reply, watcher, fn ->
            Enumerable.reduce(stream, {:cont, nil}, &suspend/2)
          end)

        {:error, e} ->
          send(reply, {reply, :error, e})
      end
    end)
  end

  # A request from another node naming a session this node does not know, or on a
  # reference released here, lost it when the connection between the two nodes dropped
  # (its owner, on the caller's node, was seen to go): :session_lost naming both nodes.
  # (That node knows the session as this node's: it sends no other.)
  defp lost(caller, session_id, refs) do
    cond do
      is_binary(session_id) and match?({:error, _}, Session.lookup(session_id)) ->
        Error.new(
          :session_lost,
          "session #{inspect(session_id)} is not open on node #{inspect(node())}, its " <>
            "node: it was closed there (when its connection with node " <>
            "#{inspect(node(caller))} dropped, the session's owner being seen to go, or " <>
            "by a process there) and its state is gone"
        )

      ref = Enum.find(refs, &LooseRefs.lost_with/1) ->
        Error.new(
          :session_lost,
          "reference #{ref.id} (#{ref.type}) was released on node #{inspect(node())} when " <>
            "its connection with node #{inspect(LooseRefs.lost_with(ref))} (its owner's) " <>
            "dropped (a node went down, or a netsplit)"
        )

      true ->
        nil
    end
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
  defp forward(reply, watcher, first) do
    step({reply, watcher}, first, 0, VllmBridge.Stream.window(), 1)
  rescue
    e in Error -> send(reply, {reply, :error, e})
  end

  defp step({reply, watcher} = to, next, ahead, window, i) do
    case next.() do
      {:suspended, chunk, cont} ->
        send(reply, {reply, :chunk, chunk})

        # The watcher keeps the references of what the caller has not read yet.
        case Ref.collect(chunk) do
          [] -> :ok
          refs -> send(watcher, {:sent, i, refs})
        end

        case room(ahead + 1, window) do
          {:ok, ahead} ->
            step(to, fn -> cont.({:cont, nil}) end, ahead, window, i + 1)

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
end
