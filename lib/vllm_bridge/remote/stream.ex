defmodule VllmBridge.Remote.Stream do
  @moduledoc false
  # The enumerating side of a stream that runs on another node (VllmBridge.Stream, when
  # VllmBridge.Call.Route answers `{:remote, ...}`): a proxy there reads the ordinary
  # local stream and sends each chunk here (VllmBridge.Remote.Proxy).
  #
  #   * flow control: the proxy sends at most a window (VllmBridge.Stream.window/0) of
  #     chunks ahead of what this process has read, and this process gives room back
  #     half a window at a time, as a local reader does to its worker. The proxy's own
  #     reading gives the worker room as a local reader's would, so the generator runs
  #     at most two windows ahead of this process (one in the worker's window, one in the
  #     proxy's);
  #   * deadlines: the proxy's stream has the same deadline (the milliseconds left when
  #     enumeration began) and the same `timeout` per chunk, and raises there what a
  #     local stream raises here; this process waits `VllmBridge.Remote.settle_margin/0`
  #     more before it gives up on the node itself, kills the proxy and raises :timeout.
  #     The proxy's spawn is given up on as the first chunk would be (its deadline or
  #     its per-chunk timeout, and the margin), and a proxy spawned after that never
  #     starts the stream (VllmBridge.Remote.spawn_proxy/3);
  #   * halting early: this process sends `{:halt, read}` (the chunks it read) to the
  #     proxy's watcher and goes on at once, waiting on nothing of the other node; the
  #     proxy halts its local stream between two chunks (which cancels the generator and
  #     releases the references of the chunks it had not sent), or, when no chunk comes
  #     within a second, kills the process that reads it (the worker cancels the
  #     generator); the watcher, which kept the references of the chunks sent past what
  #     this process credited, releases those of the chunks past `read` there, in their
  #     session (the chunks themselves, unread here, are dropped). So the contract is the
  #     local one: the reader keeps exactly the references of the chunks it read;
  #   * the node going down: the proxy's DOWN (`:noconnection`) raises `:worker_exit`
  #     (`:session_lost` in a session) naming the node.

  alias VllmBridge.{Error, Remote}
  alias VllmBridge.Remote.Proxy
  alias VllmBridge.Call.Runtime

  @doc false
  @spec open(node(), Runtime.t(), {term(), list(), term()}, keyword(), atom()) :: map()
  def open(node, %Runtime{} = rt, {target, args, kwargs}, opts, lost) do
    case Remote.refs_on({target, args, kwargs}, node) do
      :ok ->
        # The session the stream resolved to, when it is this process's current one
        # rather than named in the options (the proxy makes it its own current one).
        current = if rt.session_current?, do: rt.session_id
        left = Runtime.remaining(rt.deadline)

        opts =
          (opts || [])
          |> Keyword.drop([:timeout_profile])
          |> Keyword.merge(
            timeout: rt.timeout,
            stream_timeout: left,
            node: node,
            affinity: rt.affinity
          )

        {pid, mref, reply} =
          case Remote.spawn_proxy(
                 node,
                 {:stream, target, args, kwargs, opts, current},
                 first_chunk(rt)
               ) do
            {:ok, proxy} -> proxy
            {:error, reason} -> raise Remote.spawn_failed(node, reason, rt, "stream", lost)
          end

        %{
          remote: %{node: node, pid: pid, mref: mref, reply: reply, lost: lost, watcher: nil},
          done: false,
          deadline: rt.deadline,
          idle: rt.timeout,
          read: 0,
          obs: nil
        }

      {:error, e} ->
        raise e
    end
  end

  # When the first chunk is due: the stream's deadline or its per-chunk timeout,
  # whichever comes first, as next/1 waits for each chunk. The proxy's spawn is given up
  # then (and the margin): not at the stream's deadline alone, which is often :infinity
  # (no stream_timeout), so that a stopped node is not waited for until its connection
  # is given up.
  defp first_chunk(%Runtime{deadline: deadline, timeout: timeout}) do
    idle = Runtime.deadline(:erlang.monotonic_time(:millisecond), timeout)

    cond do
      deadline == :infinity -> idle
      idle == :infinity -> deadline
      true -> min(deadline, idle)
    end
  end

  @doc false
  @spec next(map()) :: {[term()], map()} | {:halt, map()}
  def next(%{remote: %{reply: reply, mref: mref, node: node} = r} = st) do
    receive do
      {^reply, :chunk, value} ->
        {[value], credit(st)}

      {^reply, :watcher, watcher} ->
        next(%{st | remote: %{r | watcher: watcher}})

      {^reply, :end} ->
        {:halt, %{st | done: true}}

      {^reply, :error, %Error{} = e} ->
        # The stream raised there after its last chunk: all were read.
        if r.watcher, do: send(r.watcher, :done)
        ended(st)
        raise e

      {:DOWN, ^mref, :process, _, reason} ->
        ended(st)
        raise Remote.down(node, reason, r.lost, "stream")
    after
      wait(st) ->
        # Stopped at once there (not between two chunks: none is coming).
        abandon(r, st.read, :now)
        ended(st)

        raise Error.new(
                :timeout,
                "stream on node #{inspect(node)}: no chunk within its timeout or " <>
                  "stream_timeout and #{Remote.settle_margin()} ms more; it was cancelled there"
              )
    end
  end

  # Credit goes to the watcher (known: its pid is the proxy's first message), which keeps
  # the references of the chunks not credited yet and passes the credit to the runner.
  defp credit(%{read: read, remote: %{watcher: watcher}} = st) do
    read = read + 1
    half = div(VllmBridge.Stream.window(), 2)
    if rem(read, half) == 0, do: send(watcher, {:credit, half})
    %{st | read: read}
  end

  defp wait(%{deadline: deadline, idle: idle}) do
    case min(Runtime.remaining(deadline), idle) do
      :infinity -> :infinity
      ms -> ms + Remote.settle_margin()
    end
  end

  # A stream that raised: Stream.resource runs stop/1 after, with the state from before
  # the raise; the mark tells it that nothing is left to settle.
  defp ended(%{remote: %{mref: mref}} = st) do
    finish(st)
    Process.put({__MODULE__, :ended, mref}, true)
  end

  @doc false
  @spec stop(map()) :: :ok
  def stop(%{done: true, remote: r} = st) do
    # Read to its end: the watcher has nothing left to release.
    if r.watcher, do: send(r.watcher, :done)
    finish(st)
  end

  def stop(%{remote: %{mref: mref} = r} = st) do
    if Process.delete({__MODULE__, :ended, mref}), do: :ok, else: halt(r, st)
  end

  # Halted before its end. Nothing here waits for the other node: the watcher there is
  # told how many chunks this process read, halts the stream (between two chunks, or by
  # killing the process that reads it: either cancels the generator) and releases, in
  # their session, the references of the chunks sent past those (on their way, or unread
  # here: dropped by finish/1).
  defp halt(r, st) do
    abandon(r, st.read, Proxy.halt_grace())
    finish(st)
    :ok
  end

  # The watcher's pid is the proxy's first message; while it has not come, no chunk has
  # either, and killing the runner is the halt (its watcher then releases what it sent).
  defp abandon(%{reply: reply, pid: pid} = r, read, grace) do
    watcher =
      r.watcher ||
        receive do
          {^reply, :watcher, watcher} -> watcher
        after
          0 -> nil
        end

    if watcher, do: send(watcher, {:halt, read, grace}), else: Process.exit(pid, :kill)
    :ok
  end

  defp finish(%{remote: %{mref: mref, reply: reply}}), do: Remote.done(mref, reply)
end
