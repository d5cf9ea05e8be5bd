Code.require_file("../support/telemetry_helpers.exs", __DIR__)

defmodule VllmBridge.DemoTest do
  @moduledoc """
  The demo through the whole bridge: two real Python workers as DP ranks 0 and 1 run a
  seeded schedule of MoE forward passes; the DP run must give, token for token, what
  rank 0 gives running every rank's tokens alone (no DP), and the ranks must have agreed
  on every step's counts, micro-batching and CUDA-graph mode.
  """
  use ExUnit.Case, async: false

  alias VllmBridge.Demo
  alias VllmBridge.Demo.Schedule

  @moduletag timeout: 300_000

  # The stand-in :telemetry is loaded at run time (VllmBridge.TelemetryHelpers.load!/0).
  @compile {:no_warn_undefined, :telemetry}
  @step [:vllm_bridge, :runner, :step]

  setup_all do
    dir = Path.join(System.tmp_dir!(), "vllm_demo_test_#{System.unique_integer([:positive])}")
    on_exit(fn -> File.rm_rf(dir) end)
    {:ok, lines} = Agent.start_link(fn -> [] end)
    out = fn line -> Agent.update(lines, &[line | &1]) end
    # The runner's step spans, in the order they were emitted.
    VllmBridge.TelemetryHelpers.load!()
    {:ok, spans} = Agent.start_link(fn -> [] end)
    record = fn event, m, md, _ -> Agent.update(spans, &[{event, m, md} | &1]) end

    :ok =
      :telemetry.attach_many(
        __MODULE__,
        for(e <- [:start, :stop, :exception], do: @step ++ [e]),
        record,
        nil
      )

    result = Demo.run(steps: 6, seed: 7, pool: :demo_test, weights_dir: dir, out: out)
    :telemetry.detach(__MODULE__)
    printed = lines |> Agent.get(&Enum.reverse/1) |> Enum.join("\n")
    step_events = Agent.get(spans, &Enum.reverse/1)
    Agent.stop(lines)
    Agent.stop(spans)
    %{result: result, printed: printed, step_events: step_events}
  end

  test "the DP run equals one rank running the same tokens", %{result: result} do
    %{compared: compared, mismatches: mismatches, max_abs_diff: diff} = result.check
    assert mismatches == []

    sampled =
      for {_, outs} <- result.steps, out <- outs, reduce: 0, do: (n -> n + length(out["req_ids"]))

    assert compared == sampled and compared > 10
    assert diff < 1.0e-4
  end

  test "every step ran the scheduled tokens, padded to what the ranks agreed", %{result: result} do
    for {{rank_steps, [r0, r1] = outs}, index} <- Enum.with_index(result.steps, 1) do
      for key <- ["num_tokens_across_dp", "should_ubatch", "cudagraph_mode", "moe_chunks"] do
        assert r0[key] == r1[key], "step #{index}: ranks disagree on #{key}"
      end

      for {{step, out}, rank} <- Enum.with_index(Enum.zip(rank_steps, outs)) do
        assert out["num_tokens"] == Schedule.num_tokens(step)
        assert out["num_tokens_padded"] == Enum.at(out["num_tokens_across_dp"], rank)
        assert out["num_tokens_padded"] >= out["num_tokens"]
      end
    end
  end

  test "the seeded schedule exercises micro-batching, each DP graph mode and an idle rank",
       %{result: result} do
    outs = for {_, [r0, _]} <- result.steps, do: r0
    assert Enum.any?(outs, & &1["should_ubatch"])
    # With two DP ranks the runner's dispatcher offers no FULL graph (a FULL graph cannot
    # hold the DP collectives): decode steps take PIECEWISE graphs. FULL is exercised
    # without DP (python/tests/demo/test_graphs.py).
    assert MapSet.new(outs, & &1["cudagraph_mode"]) == MapSet.new(["NONE", "PIECEWISE"])
    uniform = Enum.filter(outs, &(&1["uniform_decode"] and not &1["skipped"]))
    assert uniform != [] and Enum.all?(uniform, &(&1["cudagraph_mode"] != "FULL"))
    # step 4: rank 1 schedules nothing and runs a padded dummy pass beside rank 0
    {[_, idle_step], [r0, r1]} = Enum.at(result.steps, 3)
    assert Schedule.num_tokens(idle_step) == 0
    assert r1["num_tokens"] == 0 and r1["num_tokens_padded"] == r0["num_tokens_padded"]
    assert Enum.all?(outs, &(&1["moe_chunks"] >= 1))
  end

  test "weights were saved once and loaded by both ranks, experts split", %{result: result} do
    assert File.regular?(result.weights["path"])

    assert Enum.map(result.runners, & &1["weights_sha256"]) ==
             List.duplicate(result.weights["sha256"], 2)

    assert Enum.map(result.runners, & &1["local_experts"]) == [[0, 3], [4, 7]]
    assert [[_ | _], [_ | _]] = result.stats
  end

  test "the output shows progress, a row per step, the stats and the verdict", %{printed: printed} do
    assert printed =~ ~r/rank 0 ready: os pid \d+, device (cpu|cuda:\d+)/
    assert printed =~ "DP group: 2 ranks over gloo"
    for step <- 1..6, do: assert(printed =~ ~r/^#{step}\s+\d+ \/ \d+\s+\d+ \/ \d+/m)
  end

  test "each row says how its step ran, a graph mode run eagerly starred with its reason",
       %{result: result, printed: printed} do
    for {{_, [r0, r1]}, index} <- Enum.with_index(result.steps, 1) do
      # without CUDA a step runs emulated (its graph's pieces) or eagerly, never "replay"
      assert r0["graph"] in ["replay", "emulated", "eager"]
      if r0["cudagraph_mode"] == "NONE", do: assert(r0["graph"] == "eager")
      fallback = r0["cudagraph_mode"] != "NONE" and r0["graph"] == "eager"
      mode = if fallback, do: r0["cudagraph_mode"] <> "*", else: r0["cudagraph_mode"]
      graph = Enum.join(Enum.uniq([r0["graph"], r1["graph"]]), " / ")
      assert printed =~ ~r/^#{index}\s+.*\s#{Regex.escape(mode)}\s+#{graph}\s/m

      if fallback,
        do: assert(printed =~ "  * step #{index}, ranks 0, 1: #{r0["graph_reason"]}")
    end

    assert printed =~ "batch-size stats"
    assert printed =~ "tokens identical: "
    refute printed =~ "DIFFERENT"
  end

  test "each step of the runner is a telemetry span carrying its report's figures",
       %{result: result, step_events: events} do
    starts = for {event, m, md} <- events, event == @step ++ [:start], do: {m, md}
    stops = for {event, m, md} <- events, event == @step ++ [:stop], do: {m, md}
    assert for({event, _, _} <- events, event == @step ++ [:exception], do: event) == []
    # 6 steps of 2 ranks in the DP run, then the check's 6 merged steps on rank 0 alone.
    assert length(starts) == 18 and length(stops) == 18
    {dp, check} = Enum.split(stops, 12)

    figures = fn m, md ->
      {md.rank, m.num_tokens, m.num_tokens_padded, m.num_reqs, m.moe_chunks, md.cudagraph_mode,
       md.graph, md.should_ubatch, md.skipped}
    end

    expected =
      for {_, outs} <- result.steps, {out, rank} <- Enum.with_index(outs) do
        {rank, out["num_tokens"], out["num_tokens_padded"], out["num_reqs"], out["moe_chunks"],
         out["cudagraph_mode"], out["graph"], out["should_ubatch"], out["skipped"]}
      end

    assert Enum.sort(for {m, md} <- dp, do: figures.(m, md)) == Enum.sort(expected)
    assert Enum.all?(check, fn {_m, md} -> md.rank == 0 end)

    for {m, md} <- stops do
      assert md.error == nil and is_binary(md.session_id)
      # The runner's own times are Python's clock, the duration the BEAM's: compared only
      # with each other.
      assert Enum.all?([m.forward_time, m.step_time, m.duration], &(is_integer(&1) and &1 >= 0))
      assert m.forward_time <= m.step_time
    end

    contexts = for {_m, md} <- starts, do: md.telemetry_span_context
    assert Enum.sort(contexts) == Enum.sort(for {_m, md} <- stops, do: md.telemetry_span_context)
  end

  test "the pool is gone afterwards" do
    assert {:error, %VllmBridge.Error{type: :bad_argument}} = VllmBridge.Pool.workers(:demo_test)
  end
end
