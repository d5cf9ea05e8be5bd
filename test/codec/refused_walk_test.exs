defmodule VllmBridge.Codec.RefusedWalkTest do
  @moduledoc """
  The walk that finds a refused reply's slots and references
  (`VllmBridge.Call.Wire.Refused.contents/1`, on `VllmBridge.Codec.Msgpack.Walk`) on
  frames no worker writes: an extension payload that is not msgpack is given up alone
  (what follows it is still found), nesting past 1024 levels is skipped rather than
  followed, lengths past the frame's end end the walk with what came before, and only
  the reference form a worker writes counts. Nothing raises; nothing is allocated from
  a declared length.
  """
  use ExUnit.Case, async: true

  alias VllmBridge.{Codec, Ref}
  alias VllmBridge.Call.Wire.Refused
  alias VllmBridge.Codec.{Msgpack, SlotExt}
  alias VllmBridge.Shm.FrameSlots

  defp ref(id), do: %Ref{instance: "0123456789abcdef", id: id, session: nil, type: "T"}
  defp enc(term), do: IO.iodata_to_binary(Codec.encode(term))
  defp ext(type, payload), do: IO.iodata_to_binary(Msgpack.enc_ext(type, payload))
  defp slot(name), do: ext(8, SlotExt.payload(:uint8, [4], "", name))
  defp ids({names, refs}), do: {Enum.sort(names), refs |> Enum.map(& &1.id) |> Enum.sort()}

  test "a payload that is not msgpack is given up alone (FrameSlots' strict walk: the frame)" do
    for garbage <- [<<0xC1>>, <<0x92, 1>>, <<1, 2>>, <<0xDD, 0xFFFFFFFF::32>>],
        type <- [2, 4, 5, 6] do
      frame =
        <<0x93, 0xA2, "ok", 5, 0x94, enc(ref(1))::binary, ext(type, garbage)::binary,
          slot("r-7-1")::binary, enc(ref(2))::binary>>

      assert ids(Refused.contents(frame)) == {["r-7-1"], [1, 2]}, inspect({type, garbage})
      if type in [2, 4], do: assert(FrameSlots.names(frame, FrameSlots.prefix(7)) == [])
    end
  end

  test "nesting past 1024 levels is skipped, what follows it is found" do
    deep = Enum.reduce(1..1100, slot("r-7-2"), fn _, inner -> ext(2, <<0x91, inner::binary>>) end)

    frame =
      <<0x93, 0xA2, "ok", 5, 0x93, deep::binary, slot("r-7-3")::binary, enc(ref(3))::binary>>

    assert ids(Refused.contents(frame)) == {["r-7-3"], [3]}

    shallow =
      Enum.reduce(1..1000, slot("r-7-2"), fn _, inner -> ext(2, <<0x91, inner::binary>>) end)

    frame = <<0x93, 0xA2, "ok", 5, 0x92, shallow::binary, enc(ref(4))::binary>>
    assert ids(Refused.contents(frame)) == {["r-7-2"], [4]}
  end

  test "lengths past the frame's end end the walk with what came before" do
    before = <<0x93, 0xA2, "ok", 5, 0x95, enc(ref(5))::binary, slot("r-7-4")::binary>>

    # (An array or map that declares more than is left takes what follows as its own.)
    for {cut, refs} <- [
          {<<0xDD, 0xFFFFFFFF::32>>, [5, 6]},
          {<<0xDF, 0xFFFFFFFF::32>>, [5, 6]},
          {<<0xC6, 0xFFFFFFFF::32, 1, 2>>, [5]},
          {<<0xC9, 0xFFFFFFFF::32, 2, 0x90>>, [5]},
          {<<0xDB, 0xFFFFFFFF::32>>, [5]}
        ] do
      frame = <<before::binary, cut::binary, enc(ref(6))::binary>>
      {binary, total} = {:erlang.memory(:binary), :erlang.memory(:total)}
      assert ids(Refused.contents(frame)) == {["r-7-4"], refs}
      assert :erlang.memory(:total) - total < 16_000_000
      assert :erlang.memory(:binary) - binary < 16_000_000
    end
  end

  test "only the reference form a worker writes counts" do
    good = ["0123456789abcdef", 9, "s", "T"]

    for {payload, found} <- [
          {enc(good), [9]},
          {enc(["0123456789abcdef", 9, nil, "T"]), [9]},
          {<<0xDC, 4::16>> <> binary_part(enc(good), 1, byte_size(enc(good)) - 1), [9]},
          {enc(["0123456789abcdef", "9", "s", "T"]), []},
          {enc(["0123456789abcdef", 9, "s"]), []},
          {enc(good) <> <<0>>, []},
          {enc(["0123456789abcdef", 9, 1, "T"]), []}
        ] do
      frame = <<0x93, 0xA2, "ok", 5, ext(6, payload)::binary>>
      assert ids(Refused.contents(frame)) == {[], found}, inspect(payload)
    end
  end
end
