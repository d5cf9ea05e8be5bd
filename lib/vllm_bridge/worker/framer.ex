defmodule VllmBridge.Worker.Framer do
  @moduledoc false
  # Cuts the bytes a worker's port delivers in `:stream` mode into frame bodies (a 4-byte
  # big-endian length, then that many bytes), refusing a declared length over the limit
  # as soon as its header is seen, before anything is kept for the body.
  #
  # Why not the port's own `{packet, 4}`: the spawn driver allocates the declared length
  # when it reads a header (erts sys_drivers.c, `ready_input`), and `open_port` has no
  # bound on it, so one bad header would grow the BEAM by up to 4 GiB. Here a body takes
  # memory only as its bytes arrive (the driver's chunks of up to 64 KiB, kept as a list
  # and joined once), bounded by the limit. docs/PROTOCOL.md ("Transport") and
  # bench/results/frame-size.md have the measurements behind the choice.
  #
  # A body that shares a chunk with others is a sub-binary of that chunk (up to 64 KiB),
  # as a body used to be a binary of its own frame's size: a caller that keeps a string
  # decoded from a small reply (also a sub-binary) keeps that chunk alive, no more.
  #
  # State: `<<>>` (between frames), a binary of fewer than 4 bytes (part of a header), or
  # `{:body, missing, chunks}`: a body whose header was read, `missing` bytes still to
  # come, `chunks` the parts so far, newest first.

  @type t :: binary() | {:body, pos_integer(), [binary()]}

  @doc "The state between frames."
  @spec new() :: t()
  def new, do: <<>>

  @doc """
  The body of `chunk` when nothing is pending and the chunk is exactly one frame within
  `max` (a reply that came alone: the common case), else nil. Where it gives a body,
  `feed/3` gives `{:ok, [body], new()}`: the worker process takes this one step instead,
  keeping its framer state as it was (no tuple, no list, no update of its state).
  """
  @spec whole(t(), binary(), pos_integer()) :: binary() | nil
  def whole(<<>>, <<len::32, body::binary-size(len)>>, max) when len <= max, do: body
  def whole(_state, _chunk, _max), do: nil

  @doc """
  Feeds one chunk: the whole bodies it completes, in order, and the new state; or
  `{:too_large, length, bodies}` when a header declares more than `max` bytes (`bodies`:
  the whole ones before it). The stream cannot be trusted after that.
  """
  @spec feed(t(), binary(), pos_integer()) ::
          {:ok, [binary()], t()} | {:too_large, non_neg_integer(), [binary()]}
  # (A chunk that is exactly one frame, nothing pending, goes through `split/3` here too;
  # the worker process takes `whole/3` for it first, so this has no fast clause of its own.)
  def feed(<<>>, chunk, max), do: split(chunk, max, [])
  def feed(head, chunk, max) when is_binary(head), do: split(head <> chunk, max, [])

  def feed({:body, missing, chunks}, chunk, _max) when byte_size(chunk) < missing,
    do: {:ok, [], {:body, missing - byte_size(chunk), [chunk | chunks]}}

  def feed({:body, missing, chunks}, chunk, max) do
    <<last::binary-size(missing), rest::binary>> = chunk
    body = IO.iodata_to_binary(:lists.reverse(chunks, [last]))
    split(rest, max, [body])
  end

  # Whole frames off the front of `bin` (sub-binaries, no copy), then what is left.
  defp split(<<len::32, _::binary>>, max, done) when len > max,
    do: {:too_large, len, :lists.reverse(done)}

  defp split(<<len::32, body::binary-size(len), rest::binary>>, max, done),
    do: split(rest, max, [body | done])

  defp split(<<len::32, part::binary>>, _max, done),
    do: {:ok, :lists.reverse(done), {:body, len - byte_size(part), [part]}}

  defp split(head, _max, done), do: {:ok, :lists.reverse(done), head}
end
