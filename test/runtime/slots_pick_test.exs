defmodule VllmBridge.Runtime.SlotsPickTest do
  @moduledoc """
  `VllmBridge.Pool.Slots.reserve_any/1` and `reserve_prefer/2` (one pass over the
  counters, not a sort) reserve on a least loaded worker with room, the preferred one
  winning ties, or on none when none has room: generated loads of pools of 1 to 6
  workers, including workers that are down and counts below zero (after a correction).
  """
  use ExUnit.Case, async: true

  alias VllmBridge.Pool.{Meta, Slots}

  defp meta(loads, max) do
    size = length(loads)
    slots = :atomics.new(size + 1, signed: true)
    loads |> Enum.with_index(1) |> Enum.each(fn {load, i} -> :atomics.put(slots, i, load) end)

    %Meta{
      name: :pick,
      size: size,
      slots: slots,
      max_in_flight: max,
      max_frame_bytes: 1,
      queue_size: 0
    }
  end

  defp load do
    Enum.random([0, 0, 1, 2, 3, 4, -1, Slots.down(), Slots.down() - 1])
  end

  test "reserves on a least loaded worker with room, 5 000 generated pools" do
    seed = :erlang.phash2(make_ref())
    :rand.seed(:exsss, {seed, 19, 5})

    for _ <- 1..5_000 do
      loads = for _ <- 1..Enum.random(1..6), do: load()
      max = Enum.random(1..4)
      home = Enum.random([nil | Enum.to_list(0..(length(loads) - 1))])
      m = meta(loads, max)
      with_room = for {l, i} <- Enum.with_index(loads), l < max, do: {l, i}

      got =
        if home,
          do: Slots.reserve_prefer(m, home),
          else: Slots.reserve_any(m)

      case with_room do
        [] ->
          assert got == nil, "seed #{seed}: #{inspect({loads, max, home})}"
          assert Enum.map(1..length(loads), &:atomics.get(m.slots, &1)) == loads

        _ ->
          least = with_room |> Enum.map(&elem(&1, 0)) |> Enum.min()
          why = "seed #{seed}: #{inspect({loads, max, home, got})}"

          cond do
            # The preferred worker when it is idle (a count of 0, or below after a correction).
            home && Enum.at(loads, home) <= 0 -> assert got == home, why
            home && Enum.at(loads, home) == least -> assert got == home, why
            true -> assert Enum.at(loads, got) == least, why
          end

          # Reserved there, and nowhere else.
          expected = List.update_at(loads, got, &(&1 + 1))
          assert Enum.map(1..length(loads), &:atomics.get(m.slots, &1)) == expected
      end
    end
  end

  test "ties are spread over the pool" do
    picks = for _ <- 1..200, do: Slots.reserve_any(meta([0, 0, 0], 4))
    assert Enum.sort(Enum.uniq(picks)) == [0, 1, 2]
  end
end
