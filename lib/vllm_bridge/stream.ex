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
  `VllmBridge.Session.LooseRefs` for what a process that dies takes with it). If the
  enumerating process dies, the worker
  (which monitors it) cancels the stream the same way. An error during enumeration (a
  Python exception, a timeout, the worker dying) raises `VllmBridge.Error`. Enumerate a
  stream in one process: its chunks go to the process that began it.

  Flow control: the generator runs at most 32 chunks ahead of what the enumerating
  process has read (it waits in Python for room), so a fast generator cannot fill a slow
  consumer's mailbox; reading gives room back. While other requests wait for the same
  worker (a call made for each chunk, a second stream read in step), it does not wait:
  they run after it, and the reader may be waiting for them.
  """

  alias VllmBridge.{Error, Ref}
  alias VllmBridge.Call.{Request, Route, Runtime, Wire}
  alias VllmBridge.Session.LooseRefs

  # Python's vllm_bridge.protocol.flow.STREAM_WINDOW, and the credit sent back each time
  # half of it has been read.
  @window 32
  @credit div(@window, 2)

  @doc false
  @spec new(Wire.target(), list(), map() | keyword(), Runtime.opts()) ::
          {:ok, Enumerable.t()} | {:error, Error.t()}
  def new(target, args, kwargs, opts) do
    with {:ok, _checked} <- Runtime.resolve(opts, :stream),
         {:ok, parts} <- Wire.encode_invoke(target, args, kwargs) do
      {:ok,
       Stream.resource(
         fn -> start(target, args, kwargs, parts, opts) end,
         &next/1,
         &stop/1
       )}
    end
  end

  defp bound_ref({%VllmBridge.Ref{} = ref, _}), do: ref
  defp bound_ref(_), do: nil

  defp start(target, args, kwargs, parts, opts) do
    with {:ok, rt} <- Runtime.resolve(opts, :stream),
         {:ok, route} <- Route.resolve(rt, "stream", bound_ref(target), {args, kwargs}),
         # The target, for the worker's messages (a stream that costs it its process).
         req = Request.new("stream", [Wire.value(route.session)], true, parts, target),
         {:ok, pid, _i} <- Route.checkout(route, req, rt.deadline) do
      handle = Request.send_request(pid, req, rt.deadline, true, :demonitor)

      %{
        handle: handle,
        deadline: rt.deadline,
        idle: rt.timeout,
        done: false,
        loose: !route.session,
        read: 0
      }
    else
      {:error, %Error{} = e} -> raise e
    end
  end

  defp next(%{done: true} = st), do: {:halt, st}

  defp next(%{handle: {pid, id, mref}} = st) do
    receive do
      {^mref, :chunk, bin} ->
        case Wire.decode_reply(bin) do
          {:ok, value} ->
            # Outside a session, what the chunk references belongs to this process.
            if st.loose, do: LooseRefs.track(self(), Ref.collect(value, session: :none))
            {[value], credit(pid, id, st)}

          {:error, e} ->
            raise e
        end

      {^mref, :end, _} ->
        {:halt, %{st | done: true}}

      {^mref, :reply, bin} ->
        finished(st)

        case Wire.decode_reply(bin) do
          {:error, e} ->
            raise e

          {:ok, other} ->
            raise Error.new(:protocol, "stream #{id} answered ok #{inspect(other, limit: 5)}")
        end

      {^mref, :worker_exit, message} ->
        finished(st)
        raise Error.new(:worker_exit, message)

      {^mref, :reply_error, %Error{} = e} ->
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

  # The worker sends at most @window chunks ahead of what this process has read: room
  # for @credit more every @credit chunks read (docs/PROTOCOL.md, "Flow control").
  @doc "Chunks a stream may run ahead of its reader (the worker's hello says the same)."
  @spec window() :: pos_integer()
  def window, do: @window

  defp credit(pid, id, %{read: read} = st) do
    read = read + 1
    if rem(read, @credit) == 0, do: send(pid, {:"$vb_credit", id, @credit})
    %{st | read: read}
  end

  defp wait(%{deadline: deadline, idle: idle}), do: min(Runtime.remaining(deadline), idle)

  defp finished(%{handle: {_pid, _id, mref}}) do
    Process.demonitor(mref, [:flush])
    Request.flush(mref)
  end

  defp stop(%{done: true} = st), do: finished(st)

  # Chunks already on their way hold references nobody else can reach (outside a session
  # nobody would ever release them; in one, they would hold their objects until it
  # closes): settle with the worker (as VllmBridge.Call.Request.give_up/2 does) and release,
  # in their session, those of the chunks that came before its :cancelled (it releases
  # those of later ones itself). The answer comes on an alias of its own: the stream's
  # may be gone already (a stream that raised), and the worker's messages keep their
  # order whatever alias they use.
  defp stop(%{handle: {pid, id, mref}} = st) do
    ack = :erlang.monitor(:process, pid, [{:alias, :demonitor}])
    send(pid, {:"$vb_settle", id, ack})
    refs = drain(mref, ack, [])
    Process.demonitor(ack, [:flush])
    Request.flush(ack)
    Request.cast_release(pid, refs)
    finished(st)
  end

  defp drain(mref, ack, refs) do
    receive do
      {^ack, :cancelled, nil} ->
        refs

      {^mref, :chunk, bin} ->
        case Wire.decode_reply(bin) do
          {:ok, value} -> drain(mref, ack, Ref.collect(value) ++ refs)
          {:error, _} -> drain(mref, ack, refs)
        end

      {:DOWN, ^ack, :process, _, _} ->
        []
    end
  end
end
