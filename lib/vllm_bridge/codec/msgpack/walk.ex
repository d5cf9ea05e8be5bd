defmodule VllmBridge.Codec.Msgpack.Walk do
  @moduledoc false
  # A walk over one msgpack value by the heads of its values, building none of them, for
  # those who need a frame's extension values without decoding the frame: the result
  # slots a frame names, found by the worker process as it routes it
  # (VllmBridge.Shm.FrameSlots), and the slots and references of a reply its caller
  # refused (VllmBridge.Call.Wire.Refused).
  #
  # Every value is skipped by its head and length (a large binary or inline tensor is one
  # step); an array or map adds its elements to the values left at its level, without
  # recursion; each extension value is shown to `visit`, which says whether its payload
  # is msgpack to walk too (a level of its own, at most @max_nesting deep: the decoder's
  # limit) or bytes to skip. Nothing is allocated from a declared length: a length
  # longer than the bytes left ends the walk, or (in a payload walked `:lenient`) ends
  # that payload's walk only: its extension header says where it ends, and the walk
  # goes on from there.

  @max_nesting 1024

  @typedoc """
  Called with each extension value's type and payload, and the accumulator: `{:nested,
  acc}` walks the payload as one msgpack value (one that is not ends the whole walk,
  `{:error, acc}`), `{:lenient, acc}` too (one that is not is given up alone, the walk
  goes on after it), `{:skip, acc}` skips it.
  """
  @type visit(acc) :: (integer(), binary(), acc -> {:nested | :lenient | :skip, acc})

  @doc false
  # Walks `bin`, which must be exactly one msgpack value, for at most `budget` values
  # (:infinity: all). `{:ok, acc}` when it is one; `{:budget, acc}` when the budget ran
  # out first; `{:error, acc}` at the first thing that is not msgpack (a byte 0xC1, a
  # value cut short, bytes after the value or after a nested payload's value, nesting
  # past @max_nesting levels) outside payloads walked `:lenient`; `acc` holds what
  # `visit` made of the extension values before that point.
  @spec ext_values(binary(), pos_integer() | :infinity, visit(acc), acc) ::
          {:ok | :budget | :error, acc}
        when acc: term()
  def ext_values(bin, budget, visit, acc), do: walk(bin, 1, [], budget, visit, acc)

  # walk(bin, values left at this level, outer levels, budget, visit, acc): `outer` keeps,
  # for each nested payload being walked, what follows it, its depth and whether it is
  # walked leniently.
  defp walk(_bin, _left, _outer, 0, _v, acc), do: {:budget, acc}
  defp walk(<<>>, 0, [], _budget, _v, acc), do: {:ok, acc}

  defp walk(<<>>, 0, [{rest, left, _, _} | outer], b, v, acc),
    do: walk(rest, left, outer, b, v, acc)

  # Bytes after the value, or after a nested payload's value.
  defp walk(_trailing, 0, outer, b, v, acc), do: fail(outer, b, v, acc)

  defp walk(<<h, r::binary>>, left, outer, b, v, acc) do
    b = if b == :infinity, do: b, else: b - 1

    cond do
      # positive and negative fixint, nil, false, true
      h <= 0x7F or h >= 0xE0 or h in [0xC0, 0xC2, 0xC3] -> walk(r, left - 1, outer, b, v, acc)
      h <= 0x8F -> walk(r, left - 1 + 2 * (h - 0x80), outer, b, v, acc)
      h <= 0x9F -> walk(r, left - 1 + (h - 0x90), outer, b, v, acc)
      h <= 0xBF -> skip(r, h - 0xA0, left, outer, b, v, acc)
      true -> head(h, r, left, outer, b, v, acc)
    end
  end

  # Values cut short.
  defp walk(<<>>, _left, outer, b, v, acc), do: fail(outer, b, v, acc)

  # Not msgpack: the end of the walk, unless it is in a payload walked leniently, which
  # is given up (the walk goes on after it).
  defp fail([{rest, left, _, true} | outer], b, v, acc), do: walk(rest, left, outer, b, v, acc)
  defp fail(_outer, _b, _v, acc), do: {:error, acc}

  # Values with a length or an extension type after their first byte (bin and str
  # alike: both are bytes of a declared length).
  defp head(h, r, left, outer, b, v, acc) do
    case {h, r} do
      {h, <<n::8, r::binary>>} when h in [0xC4, 0xD9] ->
        skip(r, n, left, outer, b, v, acc)

      {h, <<n::16, r::binary>>} when h in [0xC5, 0xDA] ->
        skip(r, n, left, outer, b, v, acc)

      {h, <<n::32, r::binary>>} when h in [0xC6, 0xDB] ->
        skip(r, n, left, outer, b, v, acc)

      {0xC7, <<n::8, t::signed-8, r::binary>>} ->
        ext(t, n, r, left, outer, b, v, acc)

      {0xC8, <<n::16, t::signed-8, r::binary>>} ->
        ext(t, n, r, left, outer, b, v, acc)

      {0xC9, <<n::32, t::signed-8, r::binary>>} ->
        ext(t, n, r, left, outer, b, v, acc)

      {0xCA, _} ->
        skip(r, 4, left, outer, b, v, acc)

      {0xCB, _} ->
        skip(r, 8, left, outer, b, v, acc)

      {h, _} when h in [0xCC, 0xD0] ->
        skip(r, 1, left, outer, b, v, acc)

      {h, _} when h in [0xCD, 0xD1] ->
        skip(r, 2, left, outer, b, v, acc)

      {h, _} when h in [0xCE, 0xD2] ->
        skip(r, 4, left, outer, b, v, acc)

      {h, _} when h in [0xCF, 0xD3] ->
        skip(r, 8, left, outer, b, v, acc)

      {h, <<t::signed-8, r::binary>>} when h in 0xD4..0xD8 ->
        fixext(h, t, r, left, outer, b, v, acc)

      {0xDC, <<n::16, r::binary>>} ->
        walk(r, left - 1 + n, outer, b, v, acc)

      {0xDD, <<n::32, r::binary>>} ->
        walk(r, left - 1 + n, outer, b, v, acc)

      {0xDE, <<n::16, r::binary>>} ->
        walk(r, left - 1 + 2 * n, outer, b, v, acc)

      {0xDF, <<n::32, r::binary>>} ->
        walk(r, left - 1 + 2 * n, outer, b, v, acc)

      # 0xC1 (never used), or a head cut short
      _ ->
        fail(outer, b, v, acc)
    end
  end

  defp fixext(h, t, r, left, outer, b, v, acc),
    do: ext(t, Bitwise.bsl(1, h - 0xD4), r, left, outer, b, v, acc)

  defp skip(r, n, left, outer, b, v, acc) do
    case r do
      <<_::binary-size(n), rest::binary>> -> walk(rest, left - 1, outer, b, v, acc)
      _ -> fail(outer, b, v, acc)
    end
  end

  defp ext(t, n, r, left, outer, b, v, acc) do
    case r do
      <<payload::binary-size(n), rest::binary>> ->
        case v.(t, payload, acc) do
          {:skip, acc} -> walk(rest, left - 1, outer, b, v, acc)
          {:nested, acc} -> nest(payload, rest, left, outer, b, v, acc, false)
          {:lenient, acc} -> nest(payload, rest, left, outer, b, v, acc, true)
        end

      _ ->
        fail(outer, b, v, acc)
    end
  end

  # A payload as a level of its own, unless that would nest past @max_nesting levels
  # (lenient: skipped, as a payload that is not msgpack is).
  defp nest(payload, rest, left, outer, b, v, acc, lenient) do
    depth = depth(outer) + 1

    cond do
      depth <= @max_nesting ->
        walk(payload, 1, [{rest, left - 1, depth, lenient} | outer], b, v, acc)

      lenient ->
        walk(rest, left - 1, outer, b, v, acc)

      true ->
        fail(outer, b, v, acc)
    end
  end

  defp depth([]), do: 0
  defp depth([{_, _, d, _} | _]), do: d
end
