defmodule Mix.Tasks.Vllm.Bench do
  @shortdoc "Runs the bridge's benchmark suite (round trip, throughput, Python peer, tensors, forward context, CUDA graphs)"
  @moduledoc """
  `make bench` runs `mix vllm.bench`: every benchmark of `VllmBridge.Bench` in one run,
  each beside a floor measured in the same run, with the targets marked PASS or MISS.
  Results are printed and written to `bench/out/`. See bench/README.md.

      mix vllm.bench [--quick]

  `--quick` runs tiny counts: it checks that every part works, its figures mean nothing.
  """
  use Mix.Task

  @impl true
  @doc false
  def run(argv) do
    case OptionParser.parse(argv, strict: [quick: :boolean]) do
      {opts, [], []} ->
        Mix.Task.run("app.start")
        VllmBridge.Bench.run(opts)
        :ok

      _ ->
        Mix.raise("usage: mix vllm.bench [--quick]; got #{Enum.join(argv, " ")}")
    end
  end
end
