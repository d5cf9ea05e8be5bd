defmodule VllmBridge.Worker.Messages do
  @moduledoc false
  # The Erlang messages between a worker process (VllmBridge.Worker) and its callers
  # (VllmBridge.Call.Request, VllmBridge.Stream, a session's close): every one is built
  # and matched here, so that the protocol has one owner. Functions `send_*` build and send;
  # macros of the bare names are patterns, for `receive`, `handle_info` and `case`
  # (`require VllmBridge.Worker.Messages` first).
  #
  # To a worker process:
  #
  #   * submit   - a request for the port (a `VllmBridge.Worker.Messages.Submit`);
  #   * settle   - the caller of request `id` gives up: cancel it, then answer
  #                `cancelled` on `alias`, after anything already passed on;
  #   * credit   - a stream's reader gives room for `n` more chunks;
  #   * grace    - (to itself) `cancel_grace` ms have passed since request `id`'s cancel;
  #   * start_timeout - (to itself) `start_timeout` has passed since the stage (`:hello`,
  #                the handshake, or `:on_start`, the setup call) began.
  #
  # From a worker process, to a caller's alias (a monitor of the worker with `{:alias,
  # mode}`): `{alias, tag, payload}` with tag :window (the chunks a stream may run ahead
  # of its reader, sent before its first chunk), :end, :worker_exit (a message),
  # :reply_error (a VllmBridge.Error, the request refused before it was written) or
  # :cancelled (the answer to a settle); and `{alias, tag, frame, origin}` with tag :reply
  # or :chunk, `origin` `{max, os_pid}` (VllmBridge.Codec.SlotExt.origin/0, one term the
  # worker process builds at its hello and keeps): the worker's frame limit
  # (`max_frame_bytes`), which bounds the frame's result slots when the caller decodes it
  # (VllmBridge.Codec.SlotExt.within_reply/3), and its Python process's OS pid, whose
  # result slots alone the frame may name. It travels with the frame, so a frame read
  # after its worker process has ended is checked against that worker all the same.

  alias VllmBridge.Codec.SlotExt

  defmodule Submit do
    @moduledoc false
    # A request as its caller hands it to the worker process: `id`; `alias`, where
    # replies go (nil: nobody waits); `caller`, the process whose death cancels it (nil:
    # it runs to its end whatever becomes of its caller); the `frame` (nil when the body
    # is too long for a frame's length: it is refused by `size`); the body's `size`; the
    # `deadline` (monotonic ms, for the worker's sweep); `holds_slot`, whether it holds a
    # pool slot the worker gives back; `replies`, :one (a reply) or :stream (the window,
    # chunks, an end); `what` ({kind, target} or nil) for the worker's messages;
    # `session`, what must still be open when the request is written (nil: nothing;
    # VllmBridge.Session.Open, VllmBridge.Worker.Calls.admit/3).
    @enforce_keys [:id, :frame, :size]
    defstruct [
      :id,
      :frame,
      :size,
      alias: nil,
      caller: nil,
      deadline: :infinity,
      holds_slot: false,
      replies: :one,
      what: nil,
      session: nil
    ]

    @type t :: %__MODULE__{
            id: non_neg_integer(),
            alias: reference() | nil,
            caller: pid() | nil,
            frame: iodata() | nil,
            size: non_neg_integer(),
            deadline: integer() | :infinity,
            holds_slot: boolean(),
            replies: :one | :stream,
            what: {String.t(), term()} | nil,
            session: VllmBridge.Session.Open.which() | nil
          }
  end

  # -- to a worker process --------------------------------------------------------------------

  @spec send_submit(pid(), Submit.t()) :: :ok
  def send_submit(pid, %Submit{} = s) do
    send(pid, {:"$vb_req", s})
    :ok
  end

  defmacro submit(s), do: quote(do: {:"$vb_req", unquote(s)})

  @spec send_settle(pid(), non_neg_integer(), reference()) :: :ok
  def send_settle(pid, id, alias) do
    send(pid, {:"$vb_settle", id, alias})
    :ok
  end

  defmacro settle(id, alias), do: quote(do: {:"$vb_settle", unquote(id), unquote(alias)})

  @spec send_credit(pid(), non_neg_integer(), pos_integer()) :: :ok
  def send_credit(pid, id, n) do
    send(pid, {:"$vb_credit", id, n})
    :ok
  end

  defmacro credit(id, n), do: quote(do: {:"$vb_credit", unquote(id), unquote(n)})

  # The worker's own timers (these two macros also build the message, for
  # Process.send_after/3).
  defmacro grace(id), do: quote(do: {:"$vb_grace", unquote(id)})

  defmacro start_timeout(stage), do: quote(do: {:"$vb_start_timeout", unquote(stage)})

  # -- from a worker process, to a caller's alias ----------------------------------------------

  @spec send_reply(reference(), binary(), SlotExt.origin()) :: :ok
  def send_reply(alias, bin, origin), do: frame_to(alias, :reply, bin, origin)

  defmacro reply(alias, bin, origin),
    do: quote(do: {unquote(alias), :reply, unquote(bin), unquote(origin)})

  @spec send_window(reference(), pos_integer()) :: :ok
  def send_window(alias, n), do: to_alias(alias, :window, n)

  defmacro window(alias, n), do: quote(do: {unquote(alias), :window, unquote(n)})

  @spec send_chunk(reference(), binary(), SlotExt.origin()) :: :ok
  def send_chunk(alias, bin, origin), do: frame_to(alias, :chunk, bin, origin)

  defmacro chunk(alias, bin, origin),
    do: quote(do: {unquote(alias), :chunk, unquote(bin), unquote(origin)})

  @spec send_stream_end(reference()) :: :ok
  def send_stream_end(alias), do: to_alias(alias, :end, nil)

  defmacro stream_end(alias), do: quote(do: {unquote(alias), :end, _})

  @spec send_worker_exit(reference(), String.t()) :: :ok
  def send_worker_exit(alias, message), do: to_alias(alias, :worker_exit, message)

  defmacro worker_exit(alias, message),
    do: quote(do: {unquote(alias), :worker_exit, unquote(message)})

  @spec send_reply_error(reference(), VllmBridge.Error.t()) :: :ok
  def send_reply_error(alias, error), do: to_alias(alias, :reply_error, error)

  defmacro reply_error(alias, error),
    do: quote(do: {unquote(alias), :reply_error, %VllmBridge.Error{} = unquote(error)})

  @spec send_cancelled(reference()) :: :ok
  def send_cancelled(alias), do: to_alias(alias, :cancelled, nil)

  defmacro cancelled(alias), do: quote(do: {unquote(alias), :cancelled, nil})

  # Any message on `alias` (to drop what is left once the alias is deactivated): one
  # without a frame, and one with a frame (:reply, :chunk).
  defmacro any(alias), do: quote(do: {unquote(alias), _, _})
  defmacro any_frame(alias), do: quote(do: {unquote(alias), _, _, _})

  # The last frame of a call: :reply, or :end for a stream (`origin` as in send_reply/3).
  @spec send_finish(reference(), :reply | :end, binary() | nil, SlotExt.origin()) :: :ok
  def send_finish(alias, :reply, bin, origin), do: send_reply(alias, bin, origin)
  def send_finish(alias, :end, nil, _origin), do: send_stream_end(alias)

  defp to_alias(alias, tag, payload) do
    send(alias, {alias, tag, payload})
    :ok
  end

  defp frame_to(alias, tag, bin, origin) do
    send(alias, {alias, tag, bin, origin})
    :ok
  end
end
