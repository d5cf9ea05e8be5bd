defmodule VllmBridge.Stream do
  @moduledoc """
  A Python iterator or generator as an Elixir `Enumerable` (`VllmBridge.stream/4`).

  The request (`stream`) is sent when enumeration begins, from the enumerating process,
  and the stream's deadline (`stream_timeout`) is fixed then; each chunk must arrive
  within `timeout` ms of the previous one (and before the deadline). Each chunk is one
  element. Halting early (`Enum.take/2`, a `throw`, an exception in the consumer) sends
  `cancel`: the generator stops at its next chunk boundary and is closed, and the chunks
  still on their way are dropped, with the references in them released in their session,
  also those of chunks that had reached the enumerating process unread (see
  **References** in `VllmBridge` for what a process that dies takes with it). If the
  enumerating process dies, the worker
  (which monitors it) cancels the stream the same way. An error during enumeration (a
  Python exception, a timeout, the worker dying) raises `VllmBridge.Error`. Enumerate a
  stream in one process: its chunks go to the process that began it.

  Flow control: the generator runs at most the worker's window of chunks (its hello's
  `stream_window`, 32 for ours: `window/0`) ahead of what the enumerating process has
  read (it waits in Python for room), so a fast generator cannot fill a slow consumer's
  mailbox; reading gives room back, half a window at a time. While other requests wait for the same
  worker (a call made for each chunk, a second stream read in step), it does not wait:
  they run after it, and the reader may be waiting for them.

  On another node (a pool, session or reference there: `VllmBridge.Runtime`, "Nodes"), a
  process spawned there reads the stream as above and sends the chunks on, at most a
  window ahead of what the enumerating process has read (which gives room back the same
  way): the generator runs at most two windows ahead of the reader. The deadlines and
  errors are the same; halting early goes on at once, waiting on nothing of that node: it
  cancels the generator there (between two chunks, or by ending the process that reads
  it there when no chunk comes within a second) and the references of the chunks sent
  past those the reader read are released there, in their session, as here (a node that
  does not answer releases them when it answers again); if that node goes down,
  enumeration raises
  `:worker_exit` (`:session_lost` in a session) naming it.
  """

  alias VllmBridge.{Error, Ref, Remote}
  alias VllmBridge.Call.{Request, Route, Run, Runtime, Wire}
  alias VllmBridge.Call.Span, as: CallSpan
  alias VllmBridge.Telemetry
  alias VllmBridge.Pool.Directory
  alias VllmBridge.Session.LooseRefs
  alias VllmBridge.Worker.Messages

  require VllmBridge.Worker.Messages

  @doc false
  @spec new(Wire.target(), list(), map() | keyword(), VllmBridge.Runtime.opts()) ::
          {:ok, Enumerable.t()} | {:error, Error.t()}
  def new(target, args, kwargs, opts) do
    # Without the application nothing could serve the stream: said now, as a call would,
    # not raised from its enumeration. (A missing pool is found when enumeration begins:
    # the pool may be started in between.)
    with :ok <- Directory.app_started(),
         {:ok, _checked} <- Runtime.resolve(opts, :stream),
         {:ok, parts} <- Wire.encode_invoke(target, args, kwargs) do
      {:ok,
       Stream.resource(
         fn -> start(target, args, kwargs, parts, opts) end,
         &next_observed/1,
         &stop/1
       )}
    end
  end

  # With `:telemetry` loaded the stream runs in a `[:vllm_bridge, :call]` span of kind
  # :stream, from the start of its enumeration to its end (VllmBridge.Telemetry): the
  # state's `obs` holds the span and what it counts; nil when not observed.
  defp start(target, args, kwargs, parts, opts) do
    if Telemetry.enabled?(),
      do: start_observed(target, args, kwargs, parts, opts),
      else: start_plain(target, args, kwargs, parts, opts)
  end

  defp start_plain(target, args, kwargs, parts, opts) do
    with {:ok, rt, route} <- resolve(target, args, kwargs, opts),
         req = request(route, parts, target),
         {:ok, pid, _i} <- Route.checkout(route, req, rt.deadline) do
      open(pid, req, rt, route, nil)
    else
      {:remote, rt, node, lost} ->
        Remote.Stream.open(node, rt, {target, args, kwargs}, opts, lost)

      # The route's error (resolve/4), or the checkout's.
      {:error, _rt, %Error{} = e} ->
        raise e

      {:error, %Error{} = e} ->
        raise e
    end
  end

  defp start_observed(target, args, kwargs, parts, opts) do
    t0 = System.monotonic_time()
    system_time = System.system_time()

    case resolve(target, args, kwargs, opts) do
      # Another node's: its span is that node's (when it has :telemetry loaded).
      {:remote, rt, node, lost} ->
        Remote.Stream.open(node, rt, {target, args, kwargs}, opts, lost)

      {:ok, rt, route} ->
        span = CallSpan.start("stream", target, route, rt, t0, system_time)
        req = request(route, parts, target)
        t1 = System.monotonic_time()
        checkout = Route.checkout(route, req, rt.deadline)

        obs = %{
          span: span,
          worker: nil,
          queue_time: System.monotonic_time() - t1,
          request_bytes: req.size,
          reply_bytes: 0,
          chunks: 0
        }

        case checkout do
          {:ok, pid, index} -> open(pid, req, rt, route, %{obs | worker: index})
          {:error, e} -> raise_observed(obs, e)
        end

      {:error, rt, e} ->
        span = CallSpan.start("stream", target, nil, rt, t0, system_time)
        raise_observed(%{span: span, worker: nil}, e)
    end
  end

  defp resolve(target, args, kwargs, opts) do
    case Runtime.resolve(opts, :stream) do
      {:ok, rt} ->
        case Route.resolve(rt, "stream", Run.bound_ref(target), {args, kwargs}) do
          {:ok, route} -> {:ok, rt, route}
          {:remote, node, lost} -> {:remote, rt, node, lost}
          {:error, e} -> {:error, rt, e}
        end

      # new/4 resolved the same options: only a change of the application's config
      # in between gets here.
      {:error, e} ->
        {:error, %Runtime{}, e}
    end
  end

  # The target, for the worker's messages (a stream that costs it its process).
  # (Its session, if any, must still be open when the worker writes it.)
  defp request(route, parts, target) do
    req = Request.new("stream", pre: [Wire.value(route.session_id)], post: parts, target: target)
    %{req | session: VllmBridge.Call.Route.must_be_open(route)}
  end

  defp open(pid, req, rt, route, obs) do
    handle = Request.send_request(pid, req, rt.deadline, holds_slot: true, replies: :stream)

    %{
      handle: handle,
      deadline: rt.deadline,
      idle: rt.timeout,
      done: false,
      loose: !route.session_id,
      # The worker's window, which it sends before the first chunk.
      window: nil,
      read: 0,
      obs: obs
    }
  end

  # The span ends with :exception for whatever the stream raises (its errors are raised:
  # see the moduledoc). A start that fails: Stream.resource runs no stop/1 after it.
  defp raise_observed(obs, e) do
    raise e
  rescue
    e ->
      CallSpan.exception(obs.span, :error, e, __STACKTRACE__, obs.worker, measurements(obs))
      reraise e, __STACKTRACE__
  end

  defp next_observed(%{obs: nil} = st), do: next(st)

  defp next_observed(st) do
    next(st)
  catch
    class, reason ->
      ended(st.obs, class, reason, __STACKTRACE__)
      :erlang.raise(class, reason, __STACKTRACE__)
  end

  # A stream that raised while enumerated: Stream.resource runs stop/1 after, with the
  # state from before the raise, so the span is marked ended (in this process, which
  # enumerates it) for stop/1 not to end it again; stop/1 removes the mark.
  @ended_key :vllm_bridge_stream_span_ended

  defp ended(obs, class, reason, stacktrace) do
    CallSpan.exception(obs.span, class, reason, stacktrace, obs.worker, measurements(obs))
    Process.put({@ended_key, obs.span.metadata.telemetry_span_context}, true)
  end

  @counted [:queue_time, :request_bytes, :reply_bytes, :chunks]

  defp measurements(%{queue_time: _} = obs), do: Map.take(obs, @counted)
  defp measurements(_obs), do: %{}

  # A chunk read: counted when observed.
  defp count(%{obs: nil} = st, _bin), do: st

  defp count(%{obs: obs} = st, bin),
    do: %{
      st
      | obs: %{obs | chunks: obs.chunks + 1, reply_bytes: obs.reply_bytes + byte_size(bin)}
    }

  # The span's :stop: the stream ended (`halted` false) or its consumer stopped reading
  # first (true). Not when it raised (ended/4 did it).
  defp stop_span(%{obs: nil}), do: :ok

  defp stop_span(%{obs: obs, done: done}) do
    case Process.delete({@ended_key, obs.span.metadata.telemetry_span_context}) do
      true ->
        :ok

      nil ->
        CallSpan.stop(obs.span, :ok, obs.worker, measurements(obs), %{halted: not done})
    end
  end

  defp next(%{done: true} = st), do: {:halt, st}
  defp next(%{remote: _} = st), do: Remote.Stream.next(st)

  defp next(%{handle: {pid, id, mref}} = st) do
    receive do
      Messages.chunk(^mref, bin, origin) ->
        case Wire.decode_reply(bin, origin, pid) do
          {:ok, value} ->
            # Outside a session, what the chunk references belongs to this process.
            if st.loose, do: LooseRefs.track(self(), Ref.collect(value, session: :none))
            {[value], credit(pid, id, count(st, bin))}

          {:error, e} ->
            raise e
        end

      Messages.window(^mref, window) ->
        next(%{st | window: window})

      Messages.stream_end(^mref) ->
        {:halt, %{st | done: true}}

      Messages.reply(^mref, bin, origin) ->
        finished(st)

        case Wire.decode_reply(bin, origin, pid) do
          {:error, e} ->
            raise e

          {:ok, other} ->
            # Nobody will hold this value: what it references is released, not kept.
            Request.cast_release(pid, Ref.collect(other))
            raise Error.new(:protocol, "stream #{id} answered ok #{inspect(other, limit: 5)}")
        end

      Messages.worker_exit(^mref, message) ->
        finished(st)
        raise Error.new(:worker_exit, message)

      Messages.reply_error(^mref, e) ->
        finished(st)
        raise e

      {:DOWN, ^mref, :process, _, reason} ->
        {:error, e} = Request.worker_down(reason)
        raise e
    after
      wait(st) ->
        raise Error.new(:timeout, "stream #{id}: no chunk within its timeout or stream_timeout")
    end
  end

  # The worker sends at most a window of chunks ahead of what this process has read:
  # room for half a window more every half window read (docs/PROTOCOL.md, "Flow
  # control").
  @doc """
  The window of our own worker (`vllm_bridge.bridge.protocol.flow.STREAM_WINDOW`): chunks a
  stream may run ahead of its reader. A stream uses the window its worker announced in
  its hello (`stream_window`), this one when the hello has none.
  """
  @spec window() :: pos_integer()
  def window, do: VllmBridge.Worker.Hello.default_stream_window()

  defp credit(pid, id, %{read: read, window: window} = st) do
    read = read + 1
    credit = div(window, 2)
    if rem(read, credit) == 0, do: Messages.send_credit(pid, id, credit)
    %{st | read: read}
  end

  defp wait(%{deadline: deadline, idle: idle}), do: min(Runtime.remaining(deadline), idle)

  defp finished(%{handle: {_pid, _id, mref}}) do
    Process.demonitor(mref, [:flush])
    Request.flush(mref)
  end

  defp stop(%{remote: _} = st), do: Remote.Stream.stop(st)

  defp stop(st) do
    settle(st)
    stop_span(st)
  end

  defp settle(%{done: true} = st), do: finished(st)

  # Chunks already on their way hold references nobody else can reach (outside a session
  # nobody would ever release them; in one, they would hold their objects until it
  # closes): settle with the worker (as VllmBridge.Call.Request.give_up/2 does) and release,
  # in their session, those of the chunks that came before its :cancelled (it releases
  # those of later ones itself). The answer comes on an alias of its own: the stream's
  # may be gone already (a stream that raised), and the worker's messages keep their
  # order whatever alias they use.
  defp settle(%{handle: {pid, id, mref}} = st) do
    ack = :erlang.monitor(:process, pid, [{:alias, :demonitor}])
    Messages.send_settle(pid, id, ack)
    refs = drain(pid, mref, ack, [])
    Process.demonitor(ack, [:flush])
    Request.flush(ack)
    Request.cast_release(pid, refs)
    finished(st)
  end

  defp drain(pid, mref, ack, refs) do
    receive do
      Messages.cancelled(^ack) ->
        refs

      Messages.chunk(^mref, bin, origin) ->
        case Wire.decode_reply(bin, origin, pid) do
          {:ok, value} -> drain(pid, mref, ack, Ref.collect(value) ++ refs)
          {:error, _} -> drain(pid, mref, ack, refs)
        end

      {:DOWN, ^ack, :process, _, _} ->
        []
    end
  end
end
