defmodule Mix.Tasks.Vllm.Demo do
  @shortdoc "Runs the data-parallel MoE forward-pass demo against real Python workers"
  @moduledoc """
  The main job of the README: `make demo` runs `mix vllm.demo`.

  Two Python workers become DP ranks 0 and 1 and run several steps of forward passes of a
  small MoE transformer together; see `VllmBridge.Demo` for what happens and what is
  printed.

      mix vllm.demo [--steps N] [--seed S] [--no-check] [--nodes 2]

  `--steps` (default 6) is the number of steps, `--seed` (default 7) seeds the weights
  and the schedule, `--no-check` skips the comparison with one rank running alone.
  `--nodes 2` runs rank 1's worker on a second BEAM node started on this machine (OTP's
  `:peer` over 127.0.0.1; this node becomes `vllm_demo_<n>@127.0.0.1`, after
  `epmd -daemon`), rank 0's here: the same check must pass.
  """
  use Mix.Task

  @impl true
  @doc false
  def run(argv) do
    {opts, rest, bad} =
      OptionParser.parse(argv,
        strict: [steps: :integer, seed: :integer, check: :boolean, nodes: :integer]
      )

    if rest != [] or bad != [] do
      Mix.raise(
        "usage: mix vllm.demo [--steps N] [--seed S] [--no-check] [--nodes 2]; got #{Enum.join(argv, " ")}"
      )
    end

    if Keyword.get(opts, :steps, 6) < 1, do: Mix.raise("--steps must be at least 1")

    if Keyword.get(opts, :nodes, 1) not in [1, 2],
      do: Mix.raise("--nodes must be 1 or 2, got #{opts[:nodes]}")

    Mix.Task.run("app.start")
    %{check: check} = VllmBridge.Demo.run(opts)

    # The check is the demo's proof: a DP run that differs from rank 0 alone is a failure.
    if check && not VllmBridge.Demo.Check.passed?(check) do
      Mix.raise(
        "the DP run differs from rank 0 alone: #{length(check.mismatches)} token mismatch(es), " <>
          "largest logit difference #{check.max_abs_diff} (#{check.compared} tokens compared)"
      )
    end

    :ok
  end
end
