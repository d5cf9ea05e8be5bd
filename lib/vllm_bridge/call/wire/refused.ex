defmodule VllmBridge.Call.Wire.Refused do
  @moduledoc false
  # What a refused reply holds goes back (docs/PROTOCOL.md, "Bounds"). A reply its
  # caller's decode refuses (`VllmBridge.Call.Wire.decode_reply/3`: a result slot over
  # the reply limit, a big integer over its cap, an unknown extension, any malformed
  # value, a reply of the wrong shape) gives its caller an error and nothing else, so
  # nobody would hand back the result slots it names nor release the references it
  # carries: the slots would stay lent until the worker's reclaim (30 s), their objects
  # held until their session closes (the default session's, until the worker restarts).
  #
  # Found by a walk of the frame once the decode has failed
  # (VllmBridge.Codec.Msgpack.Walk), not by bookkeeping in the decode: the decode stops
  # where it fails, deep in the value, and never meets what comes after; the walk finds
  # every ext 8 and ext 6 in one pass by the values' heads, building no value, reading no
  # slot file and allocating nothing from a declared length, and a reply that decodes
  # never pays for it. It walks into the payloads the decoder decodes as msgpack (ext 2,
  # 4, 5 and 6), leniently: one that is not msgpack is given up alone, as its extension
  # header says where it ends.
  #
  #   * Slots: every name of the reply's worker is handed back (renamed `.free`) once;
  #     another's (another pid's, or any when the worker is not known) is left alone
  #     (VllmBridge.Codec.SlotExt.hand_back/2). The names the decode
  #     met before it failed were renamed then (read, or refused unread): a second
  #     rename finds no file and changes nothing, since a worker lends each result slot
  #     name once (docs/PROTOCOL.md, "Hand-back"); so the walk need not know where the
  #     decode stopped.
  #   * References: none reached anybody (the decode's values go with its error), so all
  #     are released, each once, by `release` requests to the worker process the reply
  #     came from, in their sessions, as those of a reply nobody reads are
  #     (VllmBridge.Worker.Unclaimed). Only the form a worker writes is taken (an array
  #     of a str, an int, a str or nil and a str); without the worker process (nil),
  #     there is nobody to release them to.
  #
  # Where the frame itself stops being msgpack (a byte 0xC1, a length past its end,
  # outside any extension payload), what comes after cannot be found: its slots are left
  # to the worker's reclaim and its references held until their session closes.

  alias VllmBridge.Call.Request
  alias VllmBridge.Codec.Msgpack.Walk
  alias VllmBridge.Codec.SlotExt
  alias VllmBridge.Ref

  @ref 6
  @slot 8
  # Payloads the decoder decodes as msgpack (tuple, dataclass, enum, reference).
  @nested [2, 4, 5, 6]

  @doc false
  # Hands back the result slots of the refused reply `frame` that are its worker's (of
  # `origin`: nil, unknown, none) and releases its references to the worker process
  # `from` (nil: unknown, none released).
  @spec settle(binary(), SlotExt.origin() | nil, pid() | nil) :: :ok
  def settle(frame, origin, from) do
    {names, refs} = contents(frame)
    os_pid = with {_max, os_pid} <- origin, do: os_pid
    names |> Enum.uniq() |> Enum.each(&SlotExt.hand_back(&1, os_pid))
    release(refs, from)
  end

  @doc false
  # The slot names and references of `frame`, as far as it can be walked (in no
  # particular order, repeats included).
  @spec contents(binary()) :: {[binary()], [Ref.t()]}
  def contents(frame) do
    {_status, found} = Walk.ext_values(frame, :infinity, &visit/3, {[], []})
    found
  end

  defp visit(@slot, payload, {names, refs} = acc) do
    case SlotExt.name(payload) do
      {:ok, name} -> {:skip, {[name | names], refs}}
      :error -> {:skip, acc}
    end
  end

  defp visit(@ref, payload, {names, refs} = acc) do
    case ref(payload) do
      {:ok, ref} -> {:lenient, {names, [ref | refs]}}
      :error -> {:lenient, acc}
    end
  end

  defp visit(type, _payload, acc) when type in @nested, do: {:lenient, acc}
  defp visit(_type, _payload, acc), do: {:skip, acc}

  defp release(_refs, nil), do: :ok

  defp release(refs, from), do: Request.cast_release(from, refs)

  # `[instance, id, session, type]` as a worker writes it.
  defp ref(payload) do
    with {:ok, r} <- array4(payload),
         {:ok, instance, r} <- str(r),
         {:ok, id, r} <- int(r),
         {:ok, session, r} <- str_or_nil(r),
         {:ok, type, <<>>} <- str(r) do
      {:ok, %Ref{instance: instance, id: id, session: session, type: type, node: node()}}
    else
      _ -> :error
    end
  end

  defp array4(<<0x94, r::binary>>), do: {:ok, r}
  defp array4(<<0xDC, 4::16, r::binary>>), do: {:ok, r}
  defp array4(<<0xDD, 4::32, r::binary>>), do: {:ok, r}
  defp array4(_), do: :error

  defp str(<<0b101::3, n::5, s::binary-size(n), r::binary>>), do: {:ok, s, r}
  defp str(<<0xD9, n::8, s::binary-size(n), r::binary>>), do: {:ok, s, r}
  defp str(<<0xDA, n::16, s::binary-size(n), r::binary>>), do: {:ok, s, r}
  defp str(<<0xDB, n::32, s::binary-size(n), r::binary>>), do: {:ok, s, r}
  defp str(_), do: :error

  defp str_or_nil(<<0xC0, r::binary>>), do: {:ok, nil, r}
  defp str_or_nil(r), do: str(r)

  defp int(<<0::1, i::7, r::binary>>), do: {:ok, i, r}
  defp int(<<0b111::3, _::5, _::binary>> = b), do: neg_fixint(b)
  defp int(<<0xCC, i::8, r::binary>>), do: {:ok, i, r}
  defp int(<<0xCD, i::16, r::binary>>), do: {:ok, i, r}
  defp int(<<0xCE, i::32, r::binary>>), do: {:ok, i, r}
  defp int(<<0xCF, i::64, r::binary>>), do: {:ok, i, r}
  defp int(<<0xD0, i::signed-8, r::binary>>), do: {:ok, i, r}
  defp int(<<0xD1, i::signed-16, r::binary>>), do: {:ok, i, r}
  defp int(<<0xD2, i::signed-32, r::binary>>), do: {:ok, i, r}
  defp int(<<0xD3, i::signed-64, r::binary>>), do: {:ok, i, r}
  defp int(_), do: :error

  defp neg_fixint(<<i::signed-8, r::binary>>), do: {:ok, i, r}
end
