defmodule VllmBridge.Demo.Check do
  @moduledoc """
  The demo's proof of equivalence: rank 0 alone, without DP (`data_parallel_size` 1),
  runs every step of every rank (the merged schedule) with the same weights; each request
  must get the same token in the same step as in the DP run, and the same logits.

  Tokens are compared exactly; logits by their largest absolute difference (0.0 when the
  runs agree bit for bit, which the model is built to do; see `vllm_bridge.demo.model.moe`).
  """

  alias VllmBridge.Demo.{Ranks, Schedule, Step}
  alias VllmBridge.Tensor

  @typedoc "What the check found."
  @type result :: %{
          compared: non_neg_integer(),
          mismatches: [String.t()],
          max_abs_diff: float()
        }

  @doc """
  Runs the reference on rank 0 (replacing its runner) and compares it with `steps`: a
  list of `{rank_steps, rank_outputs}` of the DP run. `runner_opts` are the DP run's
  `create_runner` options (the reference keeps its CUDA-graph settings).
  """
  @spec run(Ranks.t(), String.t(), [{[map()], [map()]}], keyword()) :: result()
  def run(ranks, weights_path, steps, runner_opts) do
    opts = Keyword.merge(runner_opts, data_parallel_size: 1, data_parallel_rank: 0)
    Ranks.load_runner!(ranks, 0, weights_path, opts)

    steps
    |> Enum.with_index(1)
    |> Enum.reduce(%{compared: 0, mismatches: [], max_abs_diff: 0.0}, fn
      {{rank_steps, dp_outputs}, index}, acc ->
        merged = Schedule.merge(rank_steps)
        ref = Ranks.run!(ranks, 0, "execute_model", &execute(merged, &1))
        compare(index, by_request(dp_outputs), by_request([ref]), acc)
    end)
    |> Map.update!(:mismatches, &Enum.reverse/1)
  end

  @doc """
  Runs one step of a schedule (`VllmBridge.Demo.Schedule`) on the rank whose runtime
  options `rt` are, through the generated binding of `vllm_bridge.demo.rank.execute_model`
  (`VllmBridge.Demo.Step`, which times it in a telemetry span).
  """
  @spec execute(map(), keyword()) :: {:ok, map()} | {:error, VllmBridge.Error.t()}
  def execute(step, rt), do: Step.execute(step, rt, 0)

  @doc """
  Whether a check passed: tokens compared, none different, and the logits within
  `tolerance` (default 1.0e-4; DP and one rank agree bit for bit, micro-batched steps to
  about 1.0e-6).
  """
  @spec passed?(result(), float()) :: boolean()
  def passed?(result, tolerance \\ 1.0e-4) do
    result.compared > 0 and result.mismatches == [] and result.max_abs_diff <= tolerance
  end

  # request id => {token, logits row as floats}
  defp by_request(outputs) do
    for out <- outputs,
        {{req, token}, row} <-
          Enum.zip(Enum.zip(out["req_ids"], out["sampled_token_ids"]), rows(out["logits"])),
        into: %{},
        do: {req, {token, row}}
  end

  defp rows(%Tensor{shape: [0 | _]}), do: []
  defp rows(%Tensor{} = t), do: Tensor.to_list(t)

  defp compare(index, got, want, acc) do
    missing = Map.keys(want) -- Map.keys(got)
    extra = Map.keys(got) -- Map.keys(want)

    acc =
      if missing == [] and extra == [],
        do: acc,
        else:
          mismatch(
            acc,
            "step #{index}: requests differ (missing #{inspect(missing)}, extra #{inspect(extra)})"
          )

    Enum.reduce(want, acc, fn {req, {token, row}}, acc ->
      case got do
        %{^req => {^token, dp_row}} ->
          %{
            acc
            | compared: acc.compared + 1,
              max_abs_diff: max(acc.max_abs_diff, diff(row, dp_row))
          }

        %{^req => {other, _}} ->
          mismatch(acc, "step #{index}, #{req}: DP sampled #{other}, one rank #{token}")

        _ ->
          acc
      end
    end)
  end

  defp mismatch(acc, message), do: %{acc | mismatches: [message | acc.mismatches]}

  defp diff(a, b) do
    a
    |> Enum.zip(b)
    |> Enum.reduce(0.0, fn {x, y}, worst -> max(worst, abs_diff(x, y)) end)
  end

  defp abs_diff(x, y) when is_float(x) and is_float(y), do: abs(x - y)
  # NaN and the infinities decode to atoms: equal atoms agree, anything else is as far
  # apart as it gets.
  defp abs_diff(same, same), do: 0.0
  defp abs_diff(_, _), do: 1.0e308
end
