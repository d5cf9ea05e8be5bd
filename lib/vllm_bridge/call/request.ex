defmodule VllmBridge.Call.Request do
  @moduledoc """
  The caller's side of one request to one worker process: build the frame (fresh id,
  milliseconds left of the deadline), send it to the worker, wait for the reply in the
  caller's own `receive` with the caller's own deadline.

  The caller waits on a process alias that is also a monitor of the worker
  (`:erlang.monitor/3` with `{:alias, ...}`): a reply is sent to the alias, a worker that
  dies is seen as `:DOWN`, and once the caller gives up the alias is deactivated, so a
  late reply is dropped by the runtime instead of lingering in the caller's mailbox.

  Messages a worker sends to the alias: `{alias, :reply, frame}`, `{alias, :chunk,
  frame}`, `{alias, :end, nil}`, `{alias, :worker_exit, message}`, `{alias,
  :reply_error, %VllmBridge.Error{}}` and, to a caller that gives up, `{alias,
  :cancelled, nil}`.

  **A caller that gives up loses nothing.** A reply may carry the only handle of an
  entered context, or references nobody else has, so it must not be dropped unseen.
  Instead of deactivating the alias at once, the caller settles with the worker process
  (`give_up/2`): it asks for the cancel and waits for whichever the worker sends first,
  in order:

    * the reply, which the worker had already passed on: the call succeeded, a little
      late, and the caller has its result (`{:ok, ...}` as usual);
    * `:cancelled`: the cancel went on to Python, and whatever reply still comes stops at
      the worker process, which releases the references in it, whatever their session
      (`VllmBridge.Worker`). Python drops the call if it is still queued, interrupts its
      code if it runs (the worker and the session's state stay; the caller's next call
      runs at once), and exits the context of a cancelled `enter` (once `__enter__`
      returns if it still runs, else at once), before any request that reaches it after
      the cancel, such as the caller's next call. The call answers `:timeout`. A call
      still running `cancel_grace` ms after its cancel (stuck in C code) costs the
      worker its Python process (`VllmBridge.Worker`).
  """

  alias VllmBridge.Error
  alias VllmBridge.Call.{Runtime, Wire}

  @enforce_keys [:kind]
  defstruct kind: nil, pre: [], timed: true, post: [], size: 0, target: nil

  @typedoc """
  A request before it has an id: `kind`, the encoded fields before the timeout (`pre`,
  usually the session), whether the kind carries a timeout field, the encoded fields
  after it (`post`), the bytes `pre` and `post` take (`size`, counted once), and the
  `target` it runs, if any, or a short description of what it does (only for messages:
  the worker names it when the call costs the Python process, see `VllmBridge.Worker`;
  it is copied into the request's message and kept while the request is in flight, so
  it stays small).
  """
  @type t :: %__MODULE__{
          kind: String.t(),
          pre: [iodata()],
          timed: boolean(),
          post: [iodata()],
          size: non_neg_integer(),
          target: term()
        }

  @typedoc "A request in flight: worker pid, id and the alias/monitor."
  @type handle :: {pid(), non_neg_integer(), reference()}

  @doc """
  A request of `kind` with its encoded fields and its target (see `t:t/0`). Their size
  is counted here, once: the frame limit is checked with it before anything is reserved
  (`max_size/1`), and the frame is built with it, without walking them again.
  """
  @spec new(String.t(), [iodata()], boolean(), [iodata()], term()) :: t()
  def new(kind, pre, timed, post, target \\ nil) do
    size = IO.iodata_length(pre) + IO.iodata_length(post)
    %__MODULE__{kind: kind, pre: pre, timed: timed, post: post, size: size, target: target}
  end

  @doc "The most bytes the body of `req`'s frame can take (`VllmBridge.Call.Wire.max_request_size/3`)."
  @spec max_size(t()) :: pos_integer()
  def max_size(%__MODULE__{kind: kind, timed: timed, size: size}),
    do: Wire.max_request_size(kind, timed, size)

  @doc """
  Sends `req` to `pid` and waits for its one reply until `deadline`. `counted` says the
  request holds a pool slot (the worker gives it back).
  """
  @spec call(pid() | nil, t(), integer() | :infinity, boolean()) ::
          {:ok, term()} | {:error, Error.t()}
  def call(nil, _req, _deadline, _counted),
    do: {:error, Error.new(:worker_exit, "the worker process is not running")}

  def call(pid, req, deadline, counted) do
    handle = send_request(pid, req, deadline, counted, :reply_demonitor)
    # An enter's reply holds the only handle of its context: settled, not dropped.
    await(handle, deadline, if(req.kind == "enter", do: :settle, else: true))
  end

  @doc """
  Sends `req` and returns at once; `mode` is the alias mode (`:reply_demonitor` for one
  reply, `:demonitor` for a stream). With `watch` (the default) the worker cancels the
  request if the calling process dies before its reply; without, the request runs to its
  end whatever becomes of its caller (a session's `close`).
  """
  @spec send_request(
          pid(),
          t(),
          integer() | :infinity,
          boolean(),
          :reply_demonitor | :demonitor,
          boolean()
        ) :: handle()
  def send_request(pid, %__MODULE__{} = req, deadline, counted, mode, watch \\ true) do
    id = :erlang.unique_integer([:positive])
    mref = :erlang.monitor(:process, pid, [{:alias, mode}])
    caller = if watch, do: self()
    {frame, size} = frame(req, id, deadline)
    send(pid, {:"$vb_req", id, mref, caller, frame, size, deadline, counted, what(req)})
    {pid, id, mref}
  end

  @doc "Sends `req` and forgets it (no reply is wanted; the worker drops it)."
  @spec cast(pid(), t(), integer() | :infinity) :: :ok
  def cast(pid, %__MODULE__{} = req, deadline) do
    id = :erlang.unique_integer([:positive])
    {frame, size} = frame(req, id, deadline)
    send(pid, {:"$vb_req", id, nil, nil, frame, size, deadline, false, what(req)})
    :ok
  end

  defp what(%{target: nil}), do: nil
  defp what(%{kind: kind, target: target}), do: {kind, target}

  # The frame and its body's size; no frame (nil) when the body is longer than a frame's
  # length can say: the worker refuses it by its size, as one over its frame limit.
  defp frame(%{kind: kind, pre: pre, timed: true, post: post, size: size}, id, deadline) do
    ms =
      case Runtime.remaining(deadline) do
        :infinity -> Wire.value(nil)
        left -> Wire.value(left)
      end

    framed(Wire.frame_request(kind, id, pre ++ [ms | post], size + IO.iodata_length(ms)))
  end

  defp frame(%{kind: kind, pre: pre, post: post, size: size}, id, _deadline),
    do: framed(Wire.frame_request(kind, id, pre ++ post, size))

  defp framed({:ok, frame, size}), do: {frame, size}
  defp framed({:too_large, size}), do: {nil, size}

  @doc """
  Waits until `deadline` for the one reply of a request sent with `send_request/6`. Past
  the deadline the request is cancelled (`give_up/2`), or with `cancel` false only
  forgotten: it still runs, and its reply is dropped; `:settle` is `true` for an `enter`
  (its timeout message says the context is not left entered).
  """
  @spec await(handle(), integer() | :infinity, boolean() | :settle) ::
          {:ok, term()} | {:error, Error.t()}
  def await({pid, id, mref}, deadline, cancel \\ true) do
    receive do
      {^mref, :reply, bin} -> Wire.decode_reply(bin)
      {^mref, :worker_exit, message} -> worker_exit(message)
      {^mref, :reply_error, %Error{} = e} -> {:error, e}
      {:DOWN, ^mref, :process, _, reason} -> worker_down(reason)
    after
      Runtime.remaining(deadline) ->
        case cancel do
          true ->
            give_up({pid, id, mref}, "no reply to request #{id} before its deadline")

          false ->
            forget({pid, id, mref})

          :settle ->
            give_up(
              {pid, id, mref},
              "no reply to enter #{id} before its deadline; the context is not left entered"
            )
        end
    end
  end

  defp forget({_pid, id, mref}),
    do: late_reply(mref, "no reply to request #{id} before its deadline; it still runs")

  @doc """
  Gives up on a request, settling it with the worker process: asks it to cancel the
  request, then takes the reply, if the worker had passed it on already (a late success,
  returned as one), or else the worker's `:cancelled` (a `:timeout` with `message`).
  The worker sends `:cancelled` always, after anything it passed on, so the wait ends
  (or it goes down: `:worker_exit`); and no reply is dropped on the way to a caller that
  no longer listens, so nothing it carries is lost unseen (see the moduledoc).
  """
  @spec give_up(handle(), String.t()) :: {:ok, term()} | {:error, Error.t()}
  def give_up({pid, id, mref}, message) do
    send(pid, {:"$vb_settle", id, mref})

    result =
      receive do
        {^mref, :reply, bin} -> Wire.decode_reply(bin)
        {^mref, :cancelled, nil} -> {:error, Error.new(:timeout, message)}
        {^mref, :worker_exit, worker_message} -> worker_exit(worker_message)
        {^mref, :reply_error, %Error{} = e} -> {:error, e}
        {:DOWN, ^mref, :process, _, reason} -> worker_down(reason)
      end

    Process.demonitor(mref, [:flush])
    flush(mref)
    result
  end

  @doc """
  Casts to `pid` the release of `refs`, one `release` request per session they belong to
  (`nil`: the default session). A release never brings a session into being in the
  worker, so one closed meanwhile stays closed.
  """
  @spec cast_release(pid(), [VllmBridge.Ref.t()]) :: :ok
  def cast_release(pid, refs) do
    for {session, refs} <- Enum.group_by(refs, & &1.session) do
      cast(pid, new("release", [Wire.value(session)], false, [Wire.value(refs)]), :infinity)
    end

    :ok
  end

  # Deactivates the alias, then takes a reply that made it in before that, else drops
  # whatever else arrived and answers :timeout with `message`.
  defp late_reply(mref, message) do
    Process.demonitor(mref, [:flush])

    receive do
      {^mref, :reply, bin} -> Wire.decode_reply(bin)
    after
      0 ->
        flush(mref)
        {:error, Error.new(:timeout, message)}
    end
  end

  @doc "Drops every message that arrived on `mref` (after the alias is deactivated)."
  @spec flush(reference()) :: :ok
  def flush(mref) do
    receive do
      {^mref, _, _} -> flush(mref)
    after
      0 -> :ok
    end
  end

  @doc false
  @spec worker_exit(String.t()) :: {:error, Error.t()}
  def worker_exit(message), do: {:error, Error.new(:worker_exit, message)}

  @doc false
  # A worker that went down with a request still in its mailbox: its stop reason says why
  # when it knows (VllmBridge.Worker stops with {:shutdown, {:worker_exit, message}}).
  @spec worker_down(term()) :: {:error, Error.t()}
  def worker_down({:shutdown, {:worker_exit, message}}) when is_binary(message),
    do: worker_exit(message)

  def worker_down(reason),
    do: worker_exit("the worker process exited (#{inspect(reason, limit: 5)}) during the call")
end
