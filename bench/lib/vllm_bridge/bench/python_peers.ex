defmodule VllmBridge.Bench.PythonPeers do
  @moduledoc """
  The Python parts of the benchmark run, started as processes of the project's
  interpreter: `bench/mp_peer.py` (`multiprocessing.Pool.apply` round trip of the same
  trivial call), `bench/forward_context_bench.py` (the forward-context benchmark) and
  `bench/worker_alone.py` (the Python worker beside the raw echo, without the BEAM).
  """

  @doc """
  Runs `bench/mp_peer.py`: `%{p50: us, p99: us, mean: us, calls: n}`. Option `:calls`
  (default 5 000).
  """
  @spec mp_pool_apply(String.t(), keyword()) :: map()
  def mp_pool_apply(python, opts) do
    calls = Keyword.get(opts, :calls, 5_000)
    warmup = Keyword.get(opts, :warmup, 500)
    output = run!(python, ["bench/mp_peer.py", "--calls", "#{calls}", "--warmup", "#{warmup}"])

    case Regex.run(~r/p50_us=([\d.]+) p99_us=([\d.]+) mean_us=([\d.]+)/, output) do
      [_, p50, p99, mean] ->
        %{p50: parse(p50), p99: parse(p99), mean: parse(mean), calls: calls}

      nil ->
        raise "bench/mp_peer.py printed no figures: #{output}"
    end
  end

  @doc """
  Runs the script `bench/<script>` with `args` (`bench/forward_context_bench.py`,
  `bench/worker_alone.py`: they report themselves); its output lines.
  """
  @spec lines(String.t(), String.t(), [String.t()]) :: [String.t()]
  def lines(python, script, args) do
    python |> run!([Path.join("bench", script) | args]) |> String.split("\n", trim: true)
  end

  defp run!(python, args) do
    env = [{"PYTHONPATH", Path.expand("python")}]

    case System.cmd(python, args, stderr_to_stdout: true, env: env) do
      {output, 0} -> output
      {output, status} -> raise "#{Enum.join(args, " ")} exited with #{status}: #{output}"
    end
  end

  defp parse(text), do: text |> Float.parse() |> elem(0)
end
