defmodule VllmBridge.Demo do
  @moduledoc """
  The main job (`make demo`, `mix vllm.demo`): a data-parallel forward-pass demo of a
  small MoE transformer, driven from Elixir.

    1. start 2 Python workers as DP ranks 0 and 1 (`VllmBridge.Demo.Ranks`): one pool
       here, or with `nodes: 2` rank 1's pool on a second BEAM node (printing which node
       each rank runs on), showing progress while they start, and open a session on each;
    2. both ranks join the DP group together (`vllm_bridge.dp.init_dp_group`, settings
       from their environment, which the pool option `dp:` gave);
    3. rank 0 generates the weights from a seed and saves them to a file; both ranks load
       that file with the checked loader, each keeping its own shard of the experts;
    4. run the steps of a seeded schedule with uneven token counts per rank
       (`VllmBridge.Demo.Schedule`), calling `vllm_bridge.demo.rank.execute_model` on both
       ranks at once each step (inside, both call `coordinate_batch_across_dp`, run the
       forward under `set_forward_context` and walk the MoE layers in lockstep chunks),
       printing a row per step (`VllmBridge.Demo.Report`);
    5. print each rank's batch-size statistics and the tokens each request got;
    6. check the DP run against rank 0 running all tokens alone (`VllmBridge.Demo.Check`);
    7. leave the DP group, close the sessions and stop the pool.

  `run/1` returns what happened (for tests) and prints through `:out`.
  """

  alias VllmBridge.Demo.{Check, Ranks, Report, Schedule, Step}
  alias Vllm.Dp.Module, as: Dp
  alias Vllm.ForwardContext.Module, as: FC
  alias Vllm.Demo.Rank.Module, as: Runner

  @typedoc "What a demo run did."
  @type result :: %{
          steps: [{[Schedule.rank_step()], [map()]}],
          stats: list(),
          weights: map(),
          runners: [map()],
          check: Check.result() | nil
        }

  @runner_opts [
    enable_expert_parallel: true,
    enable_dbo: true,
    dbo_prefill_token_threshold: 16,
    dbo_decode_token_threshold: 8,
    cudagraph_mode: "full_and_piecewise",
    moe_chunk_size: 32
  ]

  @doc """
  Runs the demo. Options: `:steps` (default 6), `:seed` (default 7, for the weights
  and the schedule), `:check` (run the no-DP reference, default true), `:pool` (pool
  name, default `:vllm_demo`), `:nodes` (1, default: both ranks in one pool here; 2:
  rank 1's pool on a second BEAM node on this machine, `VllmBridge.Demo.Nodes`),
  `:weights_dir` (default `tmp/demo`), `:out` (a function taking each line to print,
  default `IO.puts/1`).
  """
  @spec run(keyword()) :: result()
  def run(opts \\ []) do
    out = Keyword.get(opts, :out, &IO.puts/1)
    steps = Keyword.get(opts, :steps, 6)
    seed = Keyword.get(opts, :seed, 7)
    started = System.monotonic_time(:millisecond)

    nodes = Keyword.get(opts, :nodes, 1)
    out.("vllm_bridge demo: a data-parallel MoE forward pass driven from Elixir")

    if nodes == 2,
      do: out.("starting a second BEAM node on this machine (OTP's :peer over 127.0.0.1)")

    out.("starting 2 Python workers as DP ranks 0 and 1 (each imports torch: a few seconds)")
    pool = Keyword.get(opts, :pool, :vllm_demo)
    ranks = ok!(Ranks.start(pool, 2, out, nodes: nodes), "starting the ranks")
    if nodes == 2, do: nodes(ranks, out)

    try do
      join(ranks, out)
      weights = save_weights(ranks, seed, Keyword.get(opts, :weights_dir, "tmp/demo"), out)
      runners = load(ranks, weights["path"], out)
      results = run_steps(ranks, steps, seed, out)
      stats = stats(ranks, out)
      requests(results, out)
      check = if Keyword.get(opts, :check, true), do: check(ranks, weights, results, out)
      Ranks.both(ranks, &leave(ranks, &1))
      elapsed = (System.monotonic_time(:millisecond) - started) / 1000
      out.("done in #{:erlang.float_to_binary(elapsed, decimals: 1)} s")
      %{steps: results, stats: stats, weights: weights, runners: runners, check: check}
    after
      Ranks.stop(ranks)
    end
  end

  defp nodes(ranks, out) do
    for {node, rank} <- Enum.with_index(ranks.nodes) do
      here = if node == node(), do: "this node", else: "the peer node"
      out.("  rank #{rank} runs on node #{node} (#{here}), pool #{inspect(ranks.pool)}")
    end
  end

  defp ok!({:ok, value}, _what), do: value

  defp ok!({:error, %VllmBridge.Error{} = e}, what),
    do: raise(%{e | message: "#{what}: #{e.message}"})

  defp join(ranks, out) do
    {us, infos} = :timer.tc(fn -> Ranks.both(ranks, &join_rank(ranks, &1)) end)
    info = hd(infos)
    # By rank: with a pool per node, every session is on its pool's worker 0.
    sessions =
      ranks.sessions
      |> Enum.with_index()
      |> Enum.map_join(", ", fn {s, rank} -> "rank #{rank} #{s.id}" end)

    out.("sessions: #{sessions}")

    out.(
      "DP group: #{info.world_size} ranks over #{info.backend} at " <>
        "#{info.master_addr}:#{info.master_port} (joined in #{Report.ms(us / 1000)} ms)"
    )
  end

  # The rank, size and rendezvous come from the worker's VLLM_DP_* environment.
  defp join_rank(ranks, rank) do
    Ranks.run!(ranks, rank, "init_dp_group", &Dp.init_dp_group(__runtime__: &1))
  end

  defp save_weights(ranks, seed, dir, out) do
    path = Path.expand(Path.join(dir, "moe-seed#{seed}.pt"))
    w = Ranks.run!(ranks, 0, "save_weights", &Runner.save_weights(path, seed, __runtime__: &1))
    c = w["config"]

    out.(
      "weights: seed #{seed} -> #{Path.relative_to_cwd(w["path"])} (#{w["num_parameters"]} " <>
        "parameters, #{w["num_bytes"]} bytes, sha256 #{String.slice(w["sha256"], 0, 12)}); model: " <>
        "#{c["num_layers"]} layers, hidden #{c["hidden_size"]}, #{c["num_experts"]} experts " <>
        "top-#{c["top_k"]}, vocab #{c["vocab_size"]}, #{c["dtype"]}"
    )

    w
  end

  defp load(ranks, path, out) do
    infos =
      Ranks.both(ranks, fn rank ->
        Ranks.load_runner!(ranks, rank, path, @runner_opts)
        Ranks.run!(ranks, rank, "runner_info", &Runner.runner_info(__runtime__: &1))
      end)

    for info <- infos do
      [first, last] = info["local_experts"]

      out.(
        "  rank #{info["data_parallel_rank"]}: loaded on #{info["device"]}, experts " <>
          "#{first}-#{last} (expert parallel: #{info["expert_parallel"]}), cudagraph " <>
          "#{info["cudagraph_mode"]}, micro-batching #{if info["enable_dbo"], do: "on", else: "off"}"
      )
    end

    infos
  end

  defp run_steps(ranks, steps, seed, out) do
    out.("")
    Enum.each(Report.header(), out)

    {results, _} =
      Enum.map_reduce(1..steps, Schedule.new(ranks.size, seed: seed), fn index, schedule ->
        {rank_steps, schedule} = Schedule.next(schedule)
        {us, outputs} = :timer.tc(fn -> Ranks.both(ranks, &execute(ranks, &1, rank_steps)) end)
        out.(Report.row(index, outputs, us / 1000))
        {{rank_steps, outputs}, schedule}
      end)

    notes = Report.footnotes(Enum.map(results, &elem(&1, 1)))
    if notes != [], do: out.("* a graph mode, but the step ran eagerly:")
    Enum.each(notes, out)
    results
  end

  defp execute(ranks, rank, rank_steps) do
    step = Enum.at(rank_steps, rank)
    Ranks.run!(ranks, rank, "execute_model", &Step.execute(step, &1, rank))
  end

  defp stats(ranks, out) do
    stats =
      Ranks.both(ranks, fn rank ->
        Ranks.run!(
          ranks,
          rank,
          "get_batchsize_stats",
          &FC.get_batchsize_stats(1, __runtime__: &1)
        )
      end)

    out.("")
    out.("batch-size stats (padded tokens per forward pass x passes, median forward time):")
    Enum.each(Report.stats(stats), out)
    stats
  end

  defp requests(results, out) do
    tokens =
      for {_steps, outputs} <- results,
          output <- outputs,
          pair <- Enum.zip(output["req_ids"], output["sampled_token_ids"]),
          reduce: %{} do
        acc -> Map.update(acc, elem(pair, 0), [elem(pair, 1)], &(&1 ++ [elem(pair, 1)]))
      end

    prompts =
      for {rank_steps, _} <- results,
          step <- rank_steps,
          {req, p} <- step["new_requests"],
          into: %{},
          do: {req, length(p)}

    out.("")
    out.("tokens sampled per request (greedy):")
    Enum.each(Report.requests(tokens, prompts), out)
  end

  defp check(ranks, weights, results, out) do
    out.("")
    out.("check: rank 0 alone (no DP) runs every rank's tokens of the same steps ...")
    result = Check.run(ranks, weights["path"], results, @runner_opts)

    verdict =
      if result.mismatches == [] and result.compared > 0, do: "identical", else: "DIFFERENT"

    diff = :io_lib.format("~.2e", [result.max_abs_diff]) |> IO.iodata_to_binary()

    out.(
      "  tokens #{verdict}: #{result.compared} sampled tokens compared, " <>
        "#{length(result.mismatches)} mismatches; largest logit difference #{diff}"
    )

    Enum.each(result.mismatches, &out.("  " <> &1))
    result
  end

  defp leave(ranks, rank) do
    Ranks.run!(ranks, rank, "shutdown_runner", &Runner.shutdown_runner(__runtime__: &1))
    Ranks.run!(ranks, rank, "destroy_dp_group", &Dp.destroy_dp_group(__runtime__: &1))
  end
end
