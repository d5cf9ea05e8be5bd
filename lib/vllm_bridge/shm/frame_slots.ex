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
  # The walk is exact: a name counts only where an ext 8 payload of this worker's slot
  # pattern holds it (the same bytes in a string, a binary or a tensor's data do not), so
  # that a hand-back never renames a slot the frame does not name. Ext 2 (tuple) and
  # ext 4 (dataclass) payloads are msgpack themselves and are walked; every other value
  # is skipped by its length. A frame that is not well formed names nothing here (its
  # caller's decode fails and says so; its slots are then the worker's reclaim's).

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
    case walk(frame, 1, [], @budget, prefix, []) do
      {:ok, names} ->
        names

      :budget ->
        if :binary.match(frame, pattern) == :nomatch, do: [], else: exact(frame, prefix)

      :error ->
        []
    end
  end

  defp exact(frame, prefix) do
    case walk(frame, 1, [], @exact_max, prefix, []) do
      {:ok, names} -> names
      _ -> []
    end
  end

  # walk(bin, values left at this level, outer levels, budget, prefix, names found):
  # msgpack values are skipped by their heads; an array or map adds its elements to the
  # values left (no recursion); a nested ext payload is a level of its own (`outer` keeps
  # what follows it).
  defp walk(_bin, _left, _outer, 0, _prefix, _acc), do: :budget
  defp walk(<<>>, 0, [], _budget, _prefix, acc), do: {:ok, acc}
  defp walk(_rest, 0, [], _budget, _prefix, _acc), do: :error
  defp walk(<<>>, 0, [{rest, left} | outer], b, p, acc), do: walk(rest, left, outer, b, p, acc)
  defp walk(_trailing, 0, [_ | _], _budget, _prefix, _acc), do: :error

  defp walk(<<h, r::binary>>, left, outer, b, p, acc) do
    b = if b == :infinity, do: b, else: b - 1

    cond do
      # positive and negative fixint, nil, false, true
      h <= 0x7F or h >= 0xE0 or h in [0xC0, 0xC2, 0xC3] -> walk(r, left - 1, outer, b, p, acc)
      h <= 0x8F -> walk(r, left - 1 + 2 * (h - 0x80), outer, b, p, acc)
      h <= 0x9F -> walk(r, left - 1 + (h - 0x90), outer, b, p, acc)
      h <= 0xBF -> skip(r, h - 0xA0, left, outer, b, p, acc)
      true -> head(h, r, left, outer, b, p, acc)
    end
  end

  defp walk(<<>>, _left, _outer, _budget, _prefix, _acc), do: :error

  # Values with a length or an extension type after their first byte.
  defp head(h, r, left, outer, b, p, acc) do
    case {h, r} do
      {0xC4, <<n::8, r::binary>>} ->
        skip(r, n, left, outer, b, p, acc)

      {0xC5, <<n::16, r::binary>>} ->
        skip(r, n, left, outer, b, p, acc)

      {0xC6, <<n::32, r::binary>>} ->
        skip(r, n, left, outer, b, p, acc)

      {0xC7, <<n::8, t::signed-8, r::binary>>} ->
        ext(t, n, r, left, outer, b, p, acc)

      {0xC8, <<n::16, t::signed-8, r::binary>>} ->
        ext(t, n, r, left, outer, b, p, acc)

      {0xC9, <<n::32, t::signed-8, r::binary>>} ->
        ext(t, n, r, left, outer, b, p, acc)

      {0xCA, _} ->
        skip(r, 4, left, outer, b, p, acc)

      {0xCB, _} ->
        skip(r, 8, left, outer, b, p, acc)

      {h, _} when h in [0xCC, 0xD0] ->
        skip(r, 1, left, outer, b, p, acc)

      {h, _} when h in [0xCD, 0xD1] ->
        skip(r, 2, left, outer, b, p, acc)

      {h, _} when h in [0xCE, 0xD2] ->
        skip(r, 4, left, outer, b, p, acc)

      {h, _} when h in [0xCF, 0xD3] ->
        skip(r, 8, left, outer, b, p, acc)

      {h, <<t::signed-8, r::binary>>} when h in 0xD4..0xD8 ->
        ext(t, Bitwise.bsl(1, h - 0xD4), r, left, outer, b, p, acc)

      {0xD9, <<n::8, r::binary>>} ->
        skip(r, n, left, outer, b, p, acc)

      {0xDA, <<n::16, r::binary>>} ->
        skip(r, n, left, outer, b, p, acc)

      {0xDB, <<n::32, r::binary>>} ->
        skip(r, n, left, outer, b, p, acc)

      {0xDC, <<n::16, r::binary>>} ->
        walk(r, left - 1 + n, outer, b, p, acc)

      {0xDD, <<n::32, r::binary>>} ->
        walk(r, left - 1 + n, outer, b, p, acc)

      {0xDE, <<n::16, r::binary>>} ->
        walk(r, left - 1 + 2 * n, outer, b, p, acc)

      {0xDF, <<n::32, r::binary>>} ->
        walk(r, left - 1 + 2 * n, outer, b, p, acc)

      # 0xC1 (never used), or a head cut short
      _ ->
        :error
    end
  end

  defp skip(r, n, left, outer, b, p, acc) do
    case r do
      <<_::binary-size(n), rest::binary>> -> walk(rest, left - 1, outer, b, p, acc)
      _ -> :error
    end
  end

  defp ext(t, n, r, left, outer, b, p, acc) do
    case r do
      <<payload::binary-size(n), rest::binary>> when t == @slot ->
        walk(rest, left - 1, outer, b, p, slot(payload, p, acc))

      <<payload::binary-size(n), rest::binary>> when t in @nested ->
        walk(payload, 1, [{rest, left - 1} | outer], b, p, acc)

      <<_::binary-size(n), rest::binary>> ->
        walk(rest, left - 1, outer, b, p, acc)

      _ ->
        :error
    end
  end

  # An ext 8 payload's name, when it is a result slot of this worker (`r-<os pid>-<n>`);
  # any other (malformed, another worker's) is not for this worker's hand-back.
  defp slot(payload, {prefix, _}, acc) do
    with <<_code, ndim, len, _dev::binary-size(len), rest::binary>> <- payload,
         shape = 8 * ndim,
         <<_::binary-size(shape), n, name::binary-size(n)>> <- rest,
         true <- own?(name, prefix) do
      [name | acc]
    else
      _ -> acc
    end
  end

  defp own?(name, prefix) do
    size = byte_size(prefix)

    case name do
      <<^prefix::binary-size(size), digits::binary>> when byte_size(digits) in 1..20 ->
        for(<<c <- digits>>, c not in ?0..?9, do: c) == []

      _ ->
        false
    end
  end
end
