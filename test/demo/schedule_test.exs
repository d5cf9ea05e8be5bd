defmodule VllmBridge.Demo.ScheduleTest do
  use ExUnit.Case, async: true

  alias VllmBridge.Demo.{Report, Schedule}

  defp steps(seed, n) do
    {rows, _} =
      Enum.map_reduce(1..n, Schedule.new(2, seed: seed), fn _, s -> Schedule.next(s) end)

    rows
  end

  test "the same seed gives the same schedule, another seed another" do
    assert steps(3, 6) == steps(3, 6)
    refute steps(3, 6) == steps(4, 6)
  end

  test "requests are prefilled in chunks, then decode one token per step until finished" do
    rows = steps(5, 12)

    for rank <- [0, 1] do
      rank_rows = Enum.map(rows, &Enum.at(&1, rank))

      prompts =
        for row <- rank_rows, {id, p} <- row["new_requests"], into: %{}, do: {id, length(p)}

      for {id, len} <- prompts do
        counts = for row <- rank_rows, n = row["num_scheduled_tokens"][id], do: n
        {prefill, rest} = Enum.split_while(Enum.scan(counts, &+/2), &(&1 < len))
        # the prompt is covered exactly (chunks of at most 64), then one token per step
        if rest != [], do: assert(hd(rest) == len)
        assert Enum.all?(Enum.take(counts, length(prefill) + 1), &(&1 in 1..64))
        assert Enum.all?(Enum.drop(counts, length(prefill) + 1), &(&1 == 1))
        assert String.starts_with?(id, "r#{rank}-")
      end
    end
  end

  test "rank 1 schedules nothing in step 4, and a finished request never comes back" do
    rows = steps(7, 8)
    assert Schedule.num_tokens(Enum.at(Enum.at(rows, 3), 1)) == 0

    for rank <- [0, 1] do
      Enum.reduce(Enum.map(rows, &Enum.at(&1, rank)), MapSet.new(), fn row, done ->
        for id <- Map.keys(row["num_scheduled_tokens"]), do: refute(id in done)
        MapSet.union(done, MapSet.new(row["finished"]))
      end)
    end
  end

  test "merge puts every rank's part of a step together" do
    [a, b] = hd(steps(9, 1))
    merged = Schedule.merge([a, b])
    assert Schedule.num_tokens(merged) == Schedule.num_tokens(a) + Schedule.num_tokens(b)

    assert map_size(merged["new_requests"]) ==
             map_size(a["new_requests"]) + map_size(b["new_requests"])
  end

  test "a bad seed is refused by name" do
    assert_raise ArgumentError, ~r/seed must be an integer, got "x"/, fn ->
      Schedule.new(2, seed: "x")
    end
  end

  test "report rows line up with the header" do
    out = %{
      "num_tokens" => 5,
      "num_tokens_padded" => 8,
      "should_ubatch" => true,
      "ubatch_num_tokens" => [4, 4],
      "cudagraph_mode" => "PIECEWISE",
      "moe_chunks" => 1,
      "forward_ms" => 1.25,
      "req_ids" => ["r1-0", "r0-2"],
      "sampled_token_ids" => [7, 9],
      "skipped" => false
    }

    row = Report.row(3, [out, out], 12.0)

    assert row =~
             ~r/^3\s+5 \/ 5\s+8 \/ 8\s+yes 4\+4\s+PIECEWISE\s+1\s+1\.3 \/ 1\.3\s+12\.0\s+r0-2:9 r1-0:7 r0-2:9 r1-0:7$/

    assert Report.stats([[{8, 2, 1.5}], []]) == [
             "  rank 0: 8 tokens x2 (1.5 ms)",
             "  rank 1: (none)"
           ]
  end
end
