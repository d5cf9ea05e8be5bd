defmodule VllmBridge.Codec.FrameSlotsTest do
  @moduledoc """
  `VllmBridge.Shm.FrameSlots.names/2` (which result slots of one worker a frame names,
  read by the worker process without decoding it) finds exactly the names held in ext 8
  values of that worker's pattern, on generated frames of every size path (small frames
  searched first, large ones walked first, large ones with many values searched then
  walked): slots nested in lists, maps, tuples (ext 2) and dataclasses (ext 4), among
  decoys that hold the same bytes elsewhere (a string or binary `r-<os pid>-5`, a
  tensor's data, another worker's slot, a malformed ext 8), which must never count (a
  hand-back of a name the frame does not name could free another frame's slot). A frame
  cut short names nothing, and nothing raises.
  """
  use ExUnit.Case, async: true

  import Bitwise

  alias VllmBridge.Codec.{Msgpack, SlotExt}
  alias VllmBridge.Shm.FrameSlots
  alias VllmBridge.TestSupport.TermGen

  @os_pid 4242
  @prefix "r-#{@os_pid}-"

  # {term, names}: a generated value and the names of this worker's slots it holds.
  defp value(depth, wide) do
    if depth == 0 or :rand.uniform(4) == 1, do: leaf(), else: container(depth, wide)
  end

  defp container(depth, wide) do
    # (Wide only at the top: 300 values there take a large frame past the walk's budget.)
    n = if wide, do: Enum.random([0, 3, 20, 300]), else: Enum.random(0..4)
    parts = for _ <- 1..n//1, do: value(depth - 1, false)
    names = Enum.flat_map(parts, &elem(&1, 1))
    terms = Enum.map(parts, &elem(&1, 0))

    case :rand.uniform(4) do
      1 ->
        {terms, names}

      2 ->
        {Map.new(Enum.with_index(terms), fn {t, i} -> {"k#{i}", t} end), names}

      # A tuple (ext 2) and a dataclass (ext 4): msgpack inside an extension.
      3 ->
        {{:msgpack_ext, 2, bin(terms)}, names}

      4 ->
        {{:msgpack_ext, 4, bin(["mod.Class", %{"f" => terms}])}, names}
    end
  end

  defp leaf do
    case :rand.uniform(12) do
      1 -> {own_slot(), :own}
      2 -> {TermGen.integer() |> rem(1 <<< 62), []}
      3 -> {TermGen.float(), []}
      4 -> {Enum.random([nil, true, false]), []}
      5 -> {TermGen.string([0, 3, 40]), []}
      6 -> {TermGen.bytes([0, 10, 5000]), []}
      # Decoys: the name's bytes where no ext 8 of this worker holds them.
      7 -> {@prefix <> "#{:rand.uniform(99)}", []}
      8 -> {<<0xFF, 8, @prefix::binary, "7">>, []}
      9 -> {{:msgpack_ext, 3, tensor_payload(@prefix <> "12")}, []}
      10 -> {{:msgpack_ext, 8, SlotExt.payload(:float32, [4], "", "r-99-1")}, []}
      11 -> {{:msgpack_ext, 8, malformed_slot()}, []}
      12 -> {{:msgpack_ext, 1, @prefix <> "3"}, []}
    end
    |> then(fn
      {{:msgpack_ext, 8, payload}, :own} -> {{:msgpack_ext, 8, payload}, [slot_name(payload)]}
      other -> other
    end)
  end

  defp own_slot do
    name = @prefix <> Integer.to_string(:rand.uniform(1_000_000))
    shape = for _ <- 1..Enum.random(0..3)//1, do: :rand.uniform(9)
    dev = Enum.random(["", "cuda:0"])
    {:msgpack_ext, 8, SlotExt.payload(Enum.random([:float32, :int8, :bool]), shape, dev, name)}
  end

  defp slot_name(payload), do: payload |> SlotExt.parse() |> elem(3)

  defp malformed_slot do
    Enum.random([
      # A name of the pattern with non-digits, too long, or a payload cut short.
      SlotExt.payload(:float32, [4], "", @prefix <> "1x"),
      SlotExt.payload(:float32, [4], "", @prefix <> String.duplicate("1", 21)),
      binary_part(SlotExt.payload(:float32, [4], "", @prefix <> "5"), 0, 12),
      SlotExt.payload(:float32, [4], "", @prefix <> "5") <> "x"
    ])
  end

  defp tensor_payload(data) do
    n = byte_size(data)
    <<1, 1, 0, n::64, data::binary>>
  end

  defp bin(term), do: IO.iodata_to_binary(Msgpack.encode(term))

  defp frame(term), do: bin([Enum.random(["ok", "chunk"]), :rand.uniform(1000), term])

  defp names(frame), do: frame |> FrameSlots.names(FrameSlots.prefix(@os_pid)) |> Enum.sort()

  setup do
    seed = :rand.uniform(1_000_000_000)
    :rand.seed(:exsss, {seed, 19, 8})
    %{seed: seed}
  end

  test "exactly the worker's own ext 8 names, in generated frames of every size path", %{
    seed: seed
  } do
    paths =
      for _ <- 1..600, reduce: %{} do
        seen ->
          {term, expected} = value(Enum.random(1..5), :rand.uniform(2) == 1)
          # A large inline value beside them, sometimes (the walk skips it by its length).
          term = if :rand.uniform(4) == 1, do: [term, :rand.bytes(70_000)], else: term
          f = frame(term)
          assert names(f) == Enum.sort(expected), "seed #{seed}: #{inspect(term, limit: 8)}"

          # No proper prefix of a frame is a frame: it names nothing, and does not raise.
          cut = binary_part(f, 0, :rand.uniform(byte_size(f)) - 1)
          assert names(cut) == [], "seed #{seed}"

          path = if byte_size(f) <= 4096, do: :small, else: :large
          Map.update(seen, {path, expected != []}, 1, &(&1 + 1))
      end

    # Every path was taken, with and without names.
    for path <- [:small, :large], named <- [true, false] do
      assert Map.get(paths, {path, named}, 0) > 0, "seed #{seed}: #{inspect(paths)}"
    end
  end

  test "a large frame of many values is searched, then walked only if it holds the prefix" do
    many = Enum.to_list(1..5000)
    assert names(frame(many)) == []
    slot = own_slot()
    name = slot_name(elem(slot, 2))
    assert names(frame(many ++ [slot])) == [name]
    # The prefix among many values, but only in a string: still nothing.
    assert names(frame(many ++ [@prefix <> "9"])) == []
    # Past 16 384 values a frame is not walked at all (its slots are left to the
    # worker's reclaim), so no frame holds up the worker process for long.
    assert names(frame(Enum.to_list(1..20_000) ++ [slot])) == []
    assert names(frame(Enum.to_list(1..16_000) ++ [slot])) == [name]
  end

  test "a 64 MiB tensor inline is skipped by its length, whatever its data holds" do
    data = :binary.copy(@prefix <> "1", div(64 * 1_048_576, byte_size(@prefix) + 1))
    slot = own_slot()
    name = slot_name(elem(slot, 2))
    assert names(frame([{:msgpack_ext, 3, tensor_payload(data)}])) == []
    assert names(frame([{:msgpack_ext, 3, tensor_payload(data)}, slot])) == [name]
  end
end
