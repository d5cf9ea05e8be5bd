defmodule VllmBridge.Runtime.SlotCountTest do
  @moduledoc """
  A worker's slot count (`VllmBridge.Pool.Slots`) and the worker's sweep that sets a
  wrong one right (`VllmBridge.Worker.Calls.sweep/3`), on counters of their own (no
  worker process): a count below zero reads as idle, and the sweep never resets a
  reservation whose request may still be on its way, only one it has seen unchanged over
  a whole sweep with nothing in flight and nothing arriving; a count below what the table
  holds is set right at once.
  """
  use ExUnit.Case, async: true

  import Bitwise, only: [<<<: 2]

  alias VllmBridge.Pool.{Meta, Slots}
  alias VllmBridge.Worker.Calls

  defp meta!(load) do
    meta = %Meta{
      name: {:slot_count_test, make_ref()},
      size: 1,
      slots: Slots.new(1),
      max_in_flight: 16,
      max_frame_bytes: 1 <<< 20,
      queue_size: 0
    }

    Slots.put_load(meta, 0, load)
    meta
  end

  defp sweep(calls), do: elem(Calls.sweep(calls, System.monotonic_time(:millisecond), 1_000), 1)

  # A call in the table, as the worker adds it when its request arrives.
  defp arrived(calls, id, counted \\ true),
    do:
      Calls.add(calls, %VllmBridge.Worker.Messages.Submit{
        id: id,
        frame: nil,
        size: 0,
        holds_slot: counted,
        deadline: nil
      })

  describe "reserve_idle/2" do
    test "takes a count of 0 or below as idle, and adds one to it" do
      for load <- [0, -1, -3] do
        meta = meta!(load)
        assert Slots.reserve_idle(meta, 0) == :ok
        assert Slots.load(meta, 0) == load + 1
      end
    end

    test "refuses a positive count, and a worker that is down, leaving the count" do
      for load <- [1, 5, Slots.down(), Slots.down() - 1] do
        meta = meta!(load)
        assert Slots.reserve_idle(meta, 0) == {:busy, load}
        assert Slots.load(meta, 0) == load
      end
    end

    test "two callers racing for an idle worker: exactly one wins" do
      for load <- [0, -1] do
        meta = meta!(load)
        parent = self()

        results =
          for _ <- 1..8 do
            Task.async(fn ->
              send(parent, {:ready, self()})

              receive do
                :go -> Slots.reserve_idle(meta, 0)
              end
            end)
          end

        pids =
          Enum.map(results, fn _ ->
            assert_receive {:ready, pid}
            pid
          end)

        Enum.each(pids, &send(&1, :go))
        outcomes = Enum.map(results, &Task.await/1)
        # From 0 one caller gets it; from -1 the first takes it to 0, which is idle again.
        assert Enum.count(outcomes, &(&1 == :ok)) == if(load == 0, do: 1, else: 2)
        assert Slots.load(meta, 0) == 1
      end
    end
  end

  describe "the sweep" do
    test "leaves a reservation whose request has not arrived for one sweep" do
      meta = meta!(1)
      calls = Calls.new(meta, 0)
      calls = sweep(calls)
      assert Slots.load(meta, 0) == 1

      # Its request arrives and is answered: the count is right, never negative.
      calls = arrived(calls, 7)
      calls = Calls.finish(calls, 7, :end, nil, {1_048_576, 4242})
      assert Slots.load(meta, 0) == 0
      _ = sweep(calls)
      assert Slots.load(meta, 0) == 0
    end

    test "resets a leftover count seen unchanged over two sweeps with nothing in flight" do
      for load <- [1, 2, 16] do
        meta = meta!(load)
        calls = meta |> Calls.new(0) |> sweep()
        assert Slots.load(meta, 0) == load
        _ = sweep(calls)
        assert Slots.load(meta, 0) == 0
      end
    end

    test "does not reset a count that changed, or when requests arrived, between sweeps" do
      meta = meta!(1)
      calls = meta |> Calls.new(0) |> sweep()
      # Another caller reserved meanwhile: a count not seen before, so not reset yet.
      assert Slots.reserve(meta, 0)
      calls = sweep(calls)
      assert Slots.load(meta, 0) == 2

      # A request arrived (and was answered) since: not reset either.
      calls = calls |> arrived(8) |> Calls.finish(8, :end, nil, {1_048_576, 4242})
      assert Slots.load(meta, 0) == 1
      calls = sweep(calls)
      assert Slots.load(meta, 0) == 1

      # Unchanged over the next whole sweep, nothing arriving: reset.
      calls = sweep(calls)
      assert Slots.load(meta, 0) == 1
      _ = sweep(calls)
      assert Slots.load(meta, 0) == 0
    end

    test "sets a count below what the table holds right at once" do
      meta = meta!(-1)
      _ = meta |> Calls.new(0) |> sweep()
      assert Slots.load(meta, 0) == 0

      # Two counted calls and one that holds no slot in the table, the count at 1.
      meta = meta!(1)
      calls = meta |> Calls.new(0) |> arrived(1) |> arrived(2) |> arrived(3, false)
      _ = sweep(calls)
      assert Slots.load(meta, 0) == 2
    end

    test "leaves a worker that is down alone" do
      meta = meta!(Slots.down())
      calls = meta |> Calls.new(0) |> sweep() |> sweep() |> sweep()
      assert Slots.load(meta, 0) == Slots.down()
      assert Calls.size(calls) == 0
    end
  end
end
