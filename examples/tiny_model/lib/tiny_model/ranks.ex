defmodule TinyModel.Ranks do
  @moduledoc """
  The environment of a DP pool's workers: worker `index` is DP rank `index`.

  Used as the pool option `worker_env: {TinyModel.Ranks, :env, [opts]}`, which the
  library calls as `env(index, opts)` for each worker when the pool starts (a function
  cannot live in a release's config; a `{module, function, args}` can).
  """

  @doc """
  The environment of DP rank `index`: `VLLM_DP_RANK`, `VLLM_DP_SIZE`, the rendezvous
  (`VLLM_DP_MASTER_IP`, `VLLM_DP_MASTER_PORT`: rank 0 hosts it), the gloo backend (the
  ranks' collectives run on the CPU) and `OMP_NUM_THREADS=1` (the ranks share the
  machine's cores). Options: `:size` (required), `:master_port` (required), `:master_ip`
  (default `"127.0.0.1"`).
  """
  @spec env(non_neg_integer(), keyword()) :: [{String.t(), String.t()}]
  def env(index, opts) when is_integer(index) and index >= 0 do
    size = Keyword.fetch!(opts, :size)
    port = Keyword.fetch!(opts, :master_port)

    if index >= size,
      do: raise(ArgumentError, "worker #{index} has no DP rank in a group of #{size}")

    [
      {"VLLM_DP_RANK", Integer.to_string(index)},
      {"VLLM_DP_SIZE", Integer.to_string(size)},
      {"VLLM_DP_MASTER_IP", Keyword.get(opts, :master_ip, "127.0.0.1")},
      {"VLLM_DP_MASTER_PORT", Integer.to_string(port)},
      {"VLLM_DP_BACKEND", "gloo"},
      {"OMP_NUM_THREADS", "1"}
    ]
  end
end
