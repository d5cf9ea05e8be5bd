defmodule TinyModel.Release do
  @moduledoc """
  What a release runs to show it works: `bin/tiny_model eval "TinyModel.Release.smoke()"`
  starts the app (its configured pools: the `{module, function, args}` worker_env, the
  `{app, path}` python_path, the on_start), runs the model on the DP pair and on one rank,
  and prints what it got, one `key: value` line each.
  """

  @doc "Starts the app, runs the model on both pools, prints the results; raises on an error."
  @spec smoke() :: :ok
  def smoke do
    {:ok, _} = Application.ensure_all_started(:tiny_model)
    {:ok, infos} = TinyModel.model_infos(:tiny_dp)
    IO.puts("workers: #{Enum.map_join(infos, ", ", &"rank #{&1.dp_rank} seed #{&1.seed}")}")
    IO.puts("python_path: #{:code.priv_dir(:tiny_model)}/python")

    {:ok, dp} = TinyModel.DP.open()

    try do
      {:ok, outs} = TinyModel.DP.forward(dp, [[1, 2, 3], [4, 5]])

      for {out, rank} <- Enum.with_index(outs) do
        IO.puts(
          "dp rank #{rank}: next_tokens #{inspect(out.next_tokens)}, padded to " <>
            "#{out.context.padded_tokens}, across dp #{inspect(out.context.num_tokens_across_dp)}"
        )
      end

      {:ok, single} = TinyModel.forward([1, 2, 3, 4, 5])
      IO.puts("single rank: next_tokens #{inspect(single.next_tokens)}")
      IO.puts("agree: #{Enum.flat_map(outs, & &1.next_tokens) == single.next_tokens}")
    after
      TinyModel.DP.close(dp)
    end

    :ok
  end
end
