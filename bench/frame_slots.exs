# What the worker process pays per reply or chunk to find the result slots it names
# (VllmBridge.Shm.FrameSlots.names/2, called on every frame of a worker that writes
# slots; bench/results/shared-memory.md, "Result slots of callers that die"): frames of
# the shapes a worker sends, each measured over `n` calls in `rounds` rounds (median and
# range of the rounds, per call). No worker: the function alone, in this BEAM.
#
#   mix run bench/frame_slots.exs [rounds] [n]

alias VllmBridge.Codec.{Msgpack, SlotExt}
alias VllmBridge.Shm.FrameSlots

[rounds, n] =
  case System.argv() do
    [] -> [7, 200_000]
    [r, n] -> Enum.map([r, n], &String.to_integer/1)
  end

prefix = FrameSlots.prefix(123_456)
enc = fn term -> IO.iodata_to_binary(Msgpack.encode(term)) end
slot = {:msgpack_ext, 8, SlotExt.payload(:float32, [262_144], "", "r-123456-17")}

tensor = fn bytes ->
  {:msgpack_ext, 3, <<8, 1, 0, div(bytes, 4)::64, :rand.bytes(bytes)::binary>>}
end

frames = [
  {"ok, int (6 B)", enc.(["ok", 5, 42]), n},
  {"ok, 200 B map", enc.(["ok", 5, %{"a" => String.duplicate("x", 180), "b" => [1, 2.5]}]), n},
  {"ok, one slot", enc.(["ok", 5, slot]), n},
  {"ok, 3 slots in a map", enc.(["ok", 5, %{"a" => slot, "b" => [slot, slot]}]), n},
  {"ok, 64 KiB inline tensor", enc.(["ok", 5, tensor.(65_536)]), n},
  {"ok, 64 MiB inline tensor", enc.(["ok", 5, tensor.(64 * 1_048_576)]), 2_000},
  {"ok, list of 100 000 floats (900 KB)", enc.(["ok", 5, Enum.map(1..100_000, &(&1 * 0.5))]), 200}
]

# (The loop itself, a script's closure called per frame, is measured as "loop only": the
# cost of names/2 is a row's figure less that one.)
frames = [{"loop only (no call)", enc.(["ok", 5, 42]), n} | frames]

for {what, frame, count} <- frames do
  call =
    if what == "loop only (no call)",
      do: fn _ -> frame end,
      else: fn _ -> FrameSlots.names(frame, prefix) end

  per =
    for _ <- 1..rounds do
      {us, _} = :timer.tc(fn -> Enum.each(1..count, call) end)

      us * 1000 / count
    end
    |> Enum.sort()

  median = Enum.at(per, div(rounds, 2))
  names = length(FrameSlots.names(frame, prefix))

  IO.puts(
    "#{String.pad_trailing(what, 38)} #{byte_size(frame)} B, #{names} names: " <>
      "#{Float.round(median, 1)} ns (#{Float.round(hd(per), 1)}-#{Float.round(List.last(per), 1)})"
  )
end
