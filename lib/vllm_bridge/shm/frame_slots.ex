defmodule VllmBridge.Shm.FrameSlots do
  @moduledoc false
  # Which result slots of one worker a reply or chunk frame names (its ext 8 values,
  # docs/PROTOCOL.md "Tensors in slots"), read by the worker process without decoding
  # the frame (VllmBridge.Shm.Loans: a frame whose caller dies before decoding it has
  # them handed back).
  #
  # It runs on every reply and chunk of a worker that writes slots, so its cost is kept
  # to what a frame's size or shape allows:
  #
  #   * a frame of at most @scan_max bytes (every small reply) is searched for its
  #     worker's name prefix `r-<os pid>-` (`:binary.match/2`, one BIF call, tens of ns);
  #     only a frame that holds it is walked;
  #   * a larger frame is walked first, up to @budget values (a large inline tensor is
  #     one value, skipped by its length, so a 64 MiB reply through the pipe costs what
  #     a small one does); one with more values (a long list) is searched as above, and
  #     walked to its end only if the prefix is in it.
  #
  # The walk (VllmBridge.Codec.Msgpack.Walk) is exact: a name counts only where an ext 8
  # payload of this worker's slot pattern holds it (the same bytes in a string, a binary
  # or a tensor's data do not), so that a hand-back never renames a slot the frame does
  # not name. Ext 2 (tuple) and ext 4 (dataclass) payloads are msgpack themselves and
  # are walked; every other value is skipped by its length. A frame that is not well
  # formed names nothing here (its caller's decode fails and says so, and hands back the
  # slots it can still find: VllmBridge.Call.Wire.Refused).

  alias VllmBridge.Codec.Msgpack.Walk
  alias VllmBridge.Codec.SlotExt

  @scan_max 4096
  @budget 256
  # The most values a frame that holds the prefix is walked for (its names taken exactly):
  # past that, none are taken, and a caller that dies with that frame unread leaves its
  # slots to the worker's reclaim (docs/PROTOCOL.md, "Bounds"). All of a worker's frames
  # pass through its process: a reply of a million small values beside a slot would
  # otherwise hold the others up for tens of ms there (review finding).
  @exact_max 16_384
  @slot 8
  @nested [2, 4]

  @typedoc "A worker's name prefix (`r-<os pid>-`) and its compiled search pattern."
  @type prefix :: {binary(), :binary.cp()}

  @doc false
  # The prefix of the result slots of the worker of `os_pid`.
  @spec prefix(non_neg_integer()) :: prefix()
  def prefix(os_pid) do
    p = "r-#{os_pid}-"
    {p, :binary.compile_pattern(p)}
  end

  @doc false
  # The result slot names of the worker of `prefix` that `frame` holds in ext 8 values
  # (in no particular order; [] for most frames).
  @spec names(binary(), prefix()) :: [String.t()]
  # Shorter than the least frame that names a slot (`[kind, id, ext 8]`: 12 bytes and
  # the name's prefix, at least): a tiny reply (`["ok", 5, 42]`) is not even searched.
  def names(frame, {p, _pattern}) when byte_size(frame) < byte_size(p) + 12, do: []

  def names(frame, {_p, pattern} = prefix) when byte_size(frame) <= @scan_max do
    case :binary.match(frame, pattern) do
      :nomatch -> []
      _ -> exact(frame, prefix)
    end
  end

  def names(frame, {_p, pattern} = prefix) do
    case walk(frame, @budget, prefix) do
      {:ok, names} ->
        names

      {:budget, _} ->
        if :binary.match(frame, pattern) == :nomatch, do: [], else: exact(frame, prefix)

      {:error, _} ->
        []
    end
  end

  defp exact(frame, prefix) do
    case walk(frame, @exact_max, prefix) do
      {:ok, names} -> names
      _ -> []
    end
  end

  # The walk (VllmBridge.Codec.Msgpack.Walk) takes the names of ext 8 payloads, walks
  # into ext 2 and 4 payloads and skips every other value by its length. (The prefix
  # travels in the accumulator, so that the walk's function is the same every time.)
  defp walk(frame, budget, {p, _}) do
    case Walk.ext_values(frame, budget, &visit/3, {p, []}) do
      {status, {_p, names}} -> {status, names}
    end
  end

  defp visit(@slot, payload, {p, names} = acc), do: {:skip, slot(payload, p, acc, names)}
  defp visit(t, _payload, acc) when t in @nested, do: {:nested, acc}
  defp visit(_t, _payload, acc), do: {:skip, acc}

  # An ext 8 payload's name, when it is a result slot of this worker (`r-<os pid>-<n>`);
  # any other (malformed, another worker's) is not for this worker's hand-back.
  defp slot(payload, prefix, acc, names) do
    case SlotExt.name(payload) do
      {:ok, name} -> if SlotExt.own_prefix?(name, prefix), do: {prefix, [name | names]}, else: acc
      :error -> acc
    end
  end
end
