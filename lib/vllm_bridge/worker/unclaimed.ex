defmodule VllmBridge.Worker.Unclaimed do
  @moduledoc false
  # A reply or chunk nobody will read (its caller gave up or died; the reply to a
  # worker's `on_start`): the references in it were made for it and no process got
  # them, so nobody could ever release them (those of the default session would outlive
  # every session, those of a session would hold its objects until it closes); they are
  # released, each in its session, by release requests to this worker process. Decoded
  # only on this path, and its result slots, if any, go back to the worker unread. A
  # frame of at most @inline_max bytes is decoded in the worker process (microseconds);
  # a larger one (it may hold millions of values) in a process of its own, so that it
  # does not hold up the frames behind it.
  #
  # A frame the decode refuses (a malformed value, a big integer over its cap) still
  # releases its references and hands back its slots (VllmBridge.Call.Wire.Refused,
  # told that the worker process is the one to release them to).

  alias VllmBridge.Call.{Request, Wire}
  alias VllmBridge.Codec.SlotExt
  alias VllmBridge.Ref

  @inline_max 4096

  @doc false
  # Drops `bin` (nil: no frame) of this worker process, whose `origin` (its frame limit
  # and os pid, VllmBridge.Worker.Messages) says which result slots are its to hand
  # back, releasing its references to this worker process.
  @spec drop(binary() | nil, SlotExt.origin()) :: :ok
  def drop(nil, _origin), do: :ok
  def drop(bin, origin) when byte_size(bin) <= @inline_max, do: release_refs(bin, origin, self())

  def drop(bin, origin) do
    worker = self()
    _ = spawn(fn -> release_refs(bin, origin, worker) end)
    :ok
  end

  defp release_refs(bin, origin, worker) do
    with {:ok, value} <- SlotExt.unread(fn -> Wire.decode_reply(bin, origin, worker) end),
         [_ | _] = refs <- Ref.collect(value) do
      Request.cast_release(worker, refs)
    else
      _ -> :ok
    end
  end
end
