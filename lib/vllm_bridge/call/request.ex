defmodule VllmBridge.Call.Request do
  @moduledoc false
  # The caller's side of one request to one worker process: build the frame (fresh id,
  # milliseconds left of the deadline), send it to the worker, wait for the reply in the
  # caller's own `receive` with the caller's own deadline.
  #
  # The caller waits on a process alias that is also a monitor of the worker
  # (`:erlang.monitor/3` with `{:alias, ...}`): a reply is sent to the alias, a worker
  # that dies is seen as `:DOWN`, and once the caller gives up the alias is deactivated,
  # so a late reply is dropped by the runtime instead of lingering in the caller's
  # mailbox. The messages on the alias are VllmBridge.Worker.Messages'.
  #
  # A caller that gives up loses nothing. A reply may carry the only handle of an
  # entered context, or references nobody else has, so it must not be dropped unseen.
  # Instead of deactivating the alias at once, the caller settles with the worker
  # process (`give_up/2`): it asks for the cancel and waits for whichever the worker
  # sends first, in order:
  #
  #   * the reply, which the worker had already passed on: the call succeeded, a little
  #     late, and the caller has its result (`{:ok, ...}` as usual);
  #   * `cancelled`: the cancel went on to Python, and whatever reply still comes stops
  #     at the worker process, which releases the references in it, whatever their
  #     session (VllmBridge.Worker). Python drops the call if it is still queued,
  #     interrupts its code if it runs (the worker and the session's state stay; the
  #     caller's next call runs at once), and exits the context of a cancelled `enter`
  #     (once `__enter__` returns if it still runs, else at once), before any request
  #     that reaches it after the cancel, such as the caller's next call. The call
  #     answers `:timeout`. A call still running `cancel_grace` ms after its cancel
  #     (stuck in C code) costs the worker its Python process (VllmBridge.Worker).

  require VllmBridge.Worker.Messages

  alias VllmBridge.Error
  alias VllmBridge.Call.{Runtime, Wire}
  alias VllmBridge.Worker.Messages

  @enforce_keys [:kind]
  defstruct kind: nil, pre: [], timed: true, post: [], size: 0, target: nil, session: nil

  # A request before it has an id: `kind`, the encoded fields before the timeout (`pre`,
  # usually the session), whether the kind carries a timeout field (`timed`), the
  # encoded fields after it (`post`), the bytes `pre` and `post` take (`size`, counted
  # once), and the `target` it runs, if any, or a short description of what it does
  # (only for messages: the worker names it when the call costs the Python process, see
  # VllmBridge.Worker; it is copied into the request's message and kept while the
  # request is in flight, so it stays small). `session`: what the worker must find still
  # open as it writes the request (VllmBridge.Session.Open; nil: no such check).
  @type t :: %__MODULE__{
          kind: String.t(),
          pre: [iodata()],
          timed: boolean(),
          post: [iodata()],
          size: non_neg_integer(),
          target: term(),
          session: VllmBridge.Session.Open.which() | nil
        }

  # A request in flight: worker pid, id and the alias/monitor.
  @type handle :: {pid(), non_neg_integer(), reference()}

  # What `new/2` takes: `pre:` and `post:` (encoded fields, default []), `timed:`
  # (default true), `target:` (default nil).
  @type new_opts :: [pre: [iodata()], post: [iodata()], timed: boolean(), target: term()]

  # How `send_request/4` sends: `holds_slot:` the request holds a pool slot (the worker
  # gives it back; default false); `replies:` `:one` (the alias goes once the reply
  # came) or `:stream` (chunks, then an end; default :one); `cancel_on_caller_exit:`
  # the worker cancels the request if the calling process dies first (default true;
  # false: it runs to its end whatever becomes of its caller, as a session's close).
  @type send_opts :: [
          holds_slot: boolean(),
          replies: :one | :stream,
          cancel_on_caller_exit: boolean()
        ]

  # What `await/3` does past the deadline: `on_timeout:` `:cancel` (`give_up/2`, the
  # default), `:cancel_enter` (the same, for an enter: its message says the context is
  # not left entered), or `:forget` (the request still runs, its reply is dropped).
  @type await_opts :: [on_timeout: :cancel | :cancel_enter | :forget]

  @doc """
  A request of `kind` (see `t:new_opts/0`). The size of its fields is counted here, once:
  the frame limit is checked with it before anything is reserved (`max_size/1`), and
  the frame is built with it, without walking them again.
  """
  @spec new(String.t(), new_opts()) :: t()
  def new(kind, opts \\ []) do
    new(
      kind,
      Keyword.get(opts, :pre, []),
      Keyword.get(opts, :post, []),
      Keyword.get(opts, :timed, true),
      Keyword.get(opts, :target)
    )
  end

  @doc "`new/2` with its options as arguments (the call path's, without keyword look-ups)."
  @spec new(String.t(), [iodata()], [iodata()], boolean(), term()) :: t()
  def new(kind, pre, post, timed, target) do
    %__MODULE__{
      kind: kind,
      pre: pre,
      timed: timed,
      post: post,
      size: IO.iodata_length(pre) + IO.iodata_length(post),
      target: target
    }
  end

  @doc "The most bytes the body of `req`'s frame can take (`VllmBridge.Call.Wire.max_request_size/3`)."
  @spec max_size(t()) :: pos_integer()
  def max_size(%__MODULE__{kind: kind, timed: timed, size: size}),
    do: Wire.max_request_size(kind, size, timed: timed)

  @doc """
  Sends `req` to `pid` and waits for its one reply until `deadline` (`holds_slot:` as
  in `send_request/4`).
  """
  @spec call(pid() | nil, t(), integer() | :infinity, holds_slot: boolean()) ::
          {:ok, term()} | {:error, Error.t()}
  def call(pid, req, deadline, opts \\ [])

  def call(nil, _req, _deadline, _opts),
    do: {:error, Error.new(:worker_exit, "the worker process is not running")}

  def call(pid, req, deadline, opts) do
    {handle, left} = submit_one(pid, req, deadline, Keyword.get(opts, :holds_slot, false), true)
    receive_reply(handle, left, [on_timeout: on_timeout(req)], false)
  end

  @doc """
  `call/4`, and the byte size of the reply's frame (0 when none came: a worker that
  went down, a timeout): for the call's telemetry span (VllmBridge.Call.Run).
  """
  @spec call_sized(pid() | nil, t(), integer() | :infinity, holds_slot: boolean()) ::
          {{:ok, term()} | {:error, Error.t()}, non_neg_integer()}
  def call_sized(pid, req, deadline, opts \\ [])
  def call_sized(nil, req, deadline, opts), do: {call(nil, req, deadline, opts), 0}

  def call_sized(pid, req, deadline, opts) do
    {handle, left} = submit_one(pid, req, deadline, Keyword.get(opts, :holds_slot, false), true)
    sized(receive_reply(handle, left, [on_timeout: on_timeout(req)], true))
  end

  # An enter's reply holds the only handle of its context: settled, not dropped.
  defp on_timeout(%{kind: "enter"}), do: :cancel_enter
  defp on_timeout(_req), do: :cancel

  @doc "Sends `req` and returns at once (`t:send_opts/0`)."
  @spec send_request(pid(), t(), integer() | :infinity, send_opts()) :: handle()
  def send_request(pid, %__MODULE__{} = req, deadline, opts \\ []) do
    holds_slot = Keyword.get(opts, :holds_slot, false)
    cancel_on_caller_exit = Keyword.get(opts, :cancel_on_caller_exit, true)

    {handle, _left} =
      case Keyword.get(opts, :replies, :one) do
        :one ->
          submit_one(pid, req, deadline, holds_slot, cancel_on_caller_exit)

        :stream ->
          submit(pid, req, deadline, holds_slot, cancel_on_caller_exit, :stream, :demonitor)
      end

    handle
  end

  # A request with one reply: `send_request/4` without its keyword look-ups.
  # Both return the handle and the milliseconds that were left of the deadline when the
  # frame was built (the frame's timeout field), which `call/4` waits at most: one clock
  # read for both (84 ns each here; bench/results/caller-path.md). The wait so ends after
  # the deadline by the time between that read and the receive (microseconds, unless the
  # caller is descheduled there); the worker has the same milliseconds and answers a
  # timeout by then.
  defp submit_one(pid, req, deadline, holds_slot, cancel_on_caller_exit),
    do: submit(pid, req, deadline, holds_slot, cancel_on_caller_exit, :one, :reply_demonitor)

  defp submit(pid, req, deadline, holds_slot, cancel_on_caller_exit, replies, mode) do
    id = :erlang.unique_integer([:positive])
    mref = :erlang.monitor(:process, pid, [{:alias, mode}])
    left = Runtime.remaining(deadline)
    {frame, size} = frame(req, id, left)

    Messages.send_submit(pid, %Messages.Submit{
      id: id,
      alias: mref,
      caller: if(cancel_on_caller_exit, do: self()),
      frame: frame,
      size: size,
      deadline: deadline,
      holds_slot: holds_slot,
      replies: replies,
      what: what(req),
      session: req.session
    })

    {{pid, id, mref}, left}
  end

  @doc """
  The submit message of `req` under request id `id`, its replies going to `alias`, with no
  caller whose death cancels it (a worker's own `on_start`: VllmBridge.Worker.Starting).
  """
  @spec submit(t(), non_neg_integer(), reference(), integer() | :infinity) ::
          Messages.Submit.t()
  def submit(%__MODULE__{} = req, id, alias, deadline) do
    {frame, size} = frame(req, id, Runtime.remaining(deadline))

    %Messages.Submit{
      id: id,
      alias: alias,
      frame: frame,
      size: size,
      deadline: deadline,
      what: what(req)
    }
  end

  @doc "Sends `req` and forgets it (no reply is wanted; the worker drops it)."
  @spec cast(pid(), t(), integer() | :infinity) :: :ok
  def cast(pid, %__MODULE__{} = req, deadline) do
    id = :erlang.unique_integer([:positive])
    {frame, size} = frame(req, id, Runtime.remaining(deadline))

    Messages.send_submit(pid, %Messages.Submit{
      id: id,
      frame: frame,
      size: size,
      deadline: deadline,
      what: what(req)
    })
  end

  defp what(%{target: nil}), do: nil
  defp what(%{kind: kind, target: target}), do: {kind, target}

  # The frame and its body's size (`left`: the milliseconds left of the deadline, or
  # :infinity); no frame (nil) when the body is longer than a frame's length can say: the
  # worker refuses it by its size, as one over its frame limit.
  defp frame(%{kind: kind, pre: pre, timed: true, post: post, size: size}, id, left) do
    # (`Wire.uint/1` and the nil byte: what `Wire.value/1` gives for them.)
    ms =
      case left do
        :infinity -> <<0xC0>>
        left -> Wire.uint(left)
      end

    framed(Wire.frame_request(kind, id, pre ++ [ms | post], size + byte_size(ms)))
  end

  defp frame(%{kind: kind, pre: pre, post: post, size: size}, id, _left),
    do: framed(Wire.frame_request(kind, id, pre ++ post, size))

  defp framed({:ok, frame, size}), do: {frame, size}
  defp framed({:too_large, size}), do: {nil, size}

  @doc """
  Waits until `deadline` for the one reply of a request sent with `send_request/4`;
  past it, what `t:await_opts/0` says.
  """
  @spec await(handle(), integer() | :infinity, await_opts()) ::
          {:ok, term()} | {:error, Error.t()}
  def await(handle, deadline, opts \\ []),
    do: receive_reply(handle, Runtime.remaining(deadline), opts, false)

  @doc "`await/3`, and the byte size of the reply's frame (0 when none came)."
  @spec await_sized(handle(), integer() | :infinity, await_opts()) ::
          {{:ok, term()} | {:error, Error.t()}, non_neg_integer()}
  def await_sized(handle, deadline, opts \\ []),
    do: sized(receive_reply(handle, Runtime.remaining(deadline), opts, true))

  # `wait`: the milliseconds left (or :infinity); `sized`: whether the reply's size is
  # wanted ({:sized, result, bytes} instead of the result), so that a call that is not
  # observed pays nothing for it.
  defp receive_reply({pid, id, mref}, wait, opts, sized) do
    receive do
      Messages.reply(^mref, bin, origin) -> decode(pid, bin, origin, sized)
      Messages.worker_exit(^mref, message) -> worker_exit(message)
      Messages.reply_error(^mref, e) -> {:error, e}
      {:DOWN, ^mref, :process, _, reason} -> worker_down(reason)
    after
      wait ->
        case Keyword.get(opts, :on_timeout, :cancel) do
          :cancel ->
            settle({pid, id, mref}, "no reply to request #{id} before its deadline", sized)

          :forget ->
            late_reply(
              pid,
              mref,
              "no reply to request #{id} before its deadline; it still runs",
              sized
            )

          :cancel_enter ->
            settle(
              {pid, id, mref},
              "no reply to enter #{id} before its deadline; the context is not left entered",
              sized
            )
        end
    end
  end

  # (`origin`: the frame limit of the worker the reply came from, which bounds its slots,
  # and its Python process's os pid, whose result slots alone it may name;
  # `pid`: its worker process, to which the references of a reply refused are released.)
  defp decode(pid, bin, origin, false), do: Wire.decode_reply(bin, origin, pid)

  defp decode(pid, bin, origin, true),
    do: {:sized, Wire.decode_reply(bin, origin, pid), byte_size(bin)}

  defp sized({:sized, result, bytes}), do: {result, bytes}
  defp sized(result), do: {result, 0}

  @doc """
  Gives up on a request, settling it with the worker process: asks it to cancel the
  request, then takes the reply, if the worker had passed it on already (a late success,
  returned as one), or else the worker's `cancelled` (a `:timeout` with `message`).
  The worker sends `cancelled` always, after anything it passed on, so the wait ends
  (or it goes down: `:worker_exit`); and no reply is dropped on the way to a caller that
  no longer listens, so nothing it carries is lost unseen.
  """
  @spec give_up(handle(), String.t()) :: {:ok, term()} | {:error, Error.t()}
  def give_up(handle, message), do: settle(handle, message, false)

  defp settle({pid, id, mref}, message, sized) do
    Messages.send_settle(pid, id, mref)

    result =
      receive do
        Messages.reply(^mref, bin, origin) -> decode(pid, bin, origin, sized)
        Messages.cancelled(^mref) -> {:error, Error.new(:timeout, message)}
        Messages.worker_exit(^mref, worker_message) -> worker_exit(worker_message)
        Messages.reply_error(^mref, e) -> {:error, e}
        {:DOWN, ^mref, :process, _, reason} -> worker_down(reason)
      end

    Process.demonitor(mref, [:flush])
    flush(mref)
    result
  end

  @doc """
  Casts to `pid` the release of `refs`, one `release` request per session and worker
  instance they belong to (session `nil`: the default one), each reference once. A
  worker refuses whole a release that names another instance's reference (a value from
  an untrusted reply may carry one), which would keep its own. A release never brings a
  session into being in the worker, so one closed meanwhile stays closed.
  """
  @spec cast_release(pid(), [VllmBridge.Ref.t()]) :: :ok
  def cast_release(pid, refs) do
    for {{_instance, session}, refs} <- VllmBridge.Ref.release_groups(refs) do
      req = new("release", pre: [Wire.value(session)], post: [Wire.value(refs)], timed: false)
      cast(pid, req, :infinity)
    end

    :ok
  end

  # Deactivates the alias, then takes a reply that made it in before that, else drops
  # whatever else arrived and answers :timeout with `message`.
  defp late_reply(pid, mref, message, sized) do
    Process.demonitor(mref, [:flush])

    receive do
      Messages.reply(^mref, bin, origin) -> decode(pid, bin, origin, sized)
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
      Messages.any(^mref) -> flush(mref)
      Messages.any_frame(^mref) -> flush(mref)
    after
      0 -> :ok
    end
  end

  @doc "The `:worker_exit` error of `message`."
  @spec worker_exit(String.t()) :: {:error, Error.t()}
  def worker_exit(message), do: {:error, Error.new(:worker_exit, message)}

  @doc """
  The error of a worker that went down with a request still in its mailbox: its stop
  reason says why when it knows (VllmBridge.Worker stops with `{:shutdown,
  {:worker_exit, message}}`).
  """
  @spec worker_down(term()) :: {:error, Error.t()}
  def worker_down({:shutdown, {:worker_exit, message}}) when is_binary(message),
    do: worker_exit(message)

  def worker_down(reason),
    do: worker_exit("the worker process exited (#{inspect(reason, limit: 5)}) during the call")
end
