defmodule VllmBridge.Request do
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
  :reply_error, %VllmBridge.Error{}}` and, for an `enter` the caller cancels, `{alias,
  :cancelled, nil}`.

  **An `enter` that times out leaves no context behind.** Its reply carries the only
  handle that can exit the context, so it must not be dropped unseen. Instead of
  deactivating the alias at once, the caller settles with the worker process: it sends
  `cancel` and waits for whichever the worker sends first, in order:

    * the reply, which the worker had already passed on: the `enter` succeeded, a little
      late, and the caller has the handle (`{:ok, ...}` as usual);
    * `:cancelled`: the cancel went on to Python, which exits the context (once
      `__enter__` returns if it still runs, else at once), before any request that
      reaches it after the cancel, such as the caller's next call. The call answers
      `:timeout`.
  """

  alias VllmBridge.{Error, Runtime, Wire}

  @enforce_keys [:kind]
  defstruct kind: nil, pre: [], timed: true, post: []

  @typedoc """
  A request before it has an id: `kind`, the encoded fields before the timeout (`pre`,
  usually the session), whether the kind carries a timeout field, and the encoded fields
  after it (`post`).
  """
  @type t :: %__MODULE__{kind: String.t(), pre: [iodata()], timed: boolean(), post: [iodata()]}

  @typedoc "A request in flight: worker pid, id and the alias/monitor."
  @type handle :: {pid(), non_neg_integer(), reference()}

  @doc "A request of `kind` with its encoded fields (see `t:t/0`)."
  @spec new(String.t(), [iodata()], boolean(), [iodata()]) :: t()
  def new(kind, pre, timed, post),
    do: %__MODULE__{kind: kind, pre: pre, timed: timed, post: post}

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
  Gives up on the `enter` of `handle` without losing its context (see the moduledoc):
  asks the worker process to cancel it, then takes the reply, or the worker's
  `:cancelled` (answered with a `:timeout` carrying `message`), whichever the worker
  sent first. The worker sends `:cancelled` always, so the wait ends, or it goes down
  (`:worker_exit`).
  """
  @spec settle_enter(handle(), String.t()) :: {:ok, term()} | {:error, Error.t()}
  def settle_enter({pid, id, mref}, message) do
    send(pid, {:"$vb_settle", id, mref})

    result =
      receive do
        {^mref, :reply, bin} ->
          Wire.decode_reply(bin)

        {^mref, :cancelled, nil} ->
          {:error, Error.new(:timeout, message <> "; the context is not left entered")}

        {^mref, :worker_exit, worker_message} ->
          worker_exit(worker_message)

        {^mref, :reply_error, %Error{} = e} ->
          {:error, e}

        {:DOWN, ^mref, :process, _, reason} ->
          worker_down(reason)
      end

    Process.demonitor(mref, [:flush])
    flush(mref)
    result
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

    send(
      pid,
      {:"$vb_req", id, mref, caller, frame(req, id, deadline), deadline, counted}
    )

    {pid, id, mref}
  end

  @doc "Sends `req` and forgets it (no reply is wanted; the worker drops it)."
  @spec cast(pid(), t(), integer() | :infinity) :: :ok
  def cast(pid, %__MODULE__{} = req, deadline) do
    id = :erlang.unique_integer([:positive])
    send(pid, {:"$vb_req", id, nil, nil, frame(req, id, deadline), deadline, false})
    :ok
  end

  defp frame(%{kind: kind, pre: pre, timed: true, post: post}, id, deadline) do
    ms =
      case Runtime.remaining(deadline) do
        :infinity -> nil
        left -> left
      end

    Wire.request(kind, id, pre ++ [Wire.value(ms) | post])
  end

  defp frame(%{kind: kind, pre: pre, post: post}, id, _deadline),
    do: Wire.request(kind, id, pre ++ post)

  @doc """
  Waits until `deadline` for the one reply of a request sent with `send_request/6`. Past
  the deadline the request is cancelled (`give_up/1`), or with `cancel` false only
  forgotten: it still runs, and its reply is dropped; with `:settle`, the request (an
  `enter`) is settled with the worker (`settle_enter/2`).
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
          true -> give_up({pid, id, mref})
          false -> forget({pid, id, mref})
          :settle -> settle_enter({pid, id, mref}, "no reply to enter #{id} before its deadline")
        end
    end
  end

  defp forget({_pid, id, mref}),
    do: late_reply(mref, "no reply to request #{id} before its deadline; it still runs")

  @doc """
  Gives up on a request: tells the worker to cancel it, deactivates the alias and takes
  back any reply that made it in before that.
  """
  @spec give_up(handle()) :: {:ok, term()} | {:error, Error.t()}
  def give_up({pid, id, mref}) do
    send(pid, {:"$vb_cancel", id})
    late_reply(mref, "no reply to request #{id} before its deadline")
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
  @spec worker_down(term()) :: {:error, Error.t()}
  def worker_down(reason),
    do: worker_exit("the worker process exited (#{inspect(reason, limit: 5)}) during the call")
end
