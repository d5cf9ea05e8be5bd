defmodule TinyModel do
  @moduledoc """
  An example app of vllm_bridge: its own Python model (`priv/python/tiny_lm.py`), bound
  as `TinyModel.Py.TinyLm.*` by `mix vllm.gen.bindings`, loaded in every worker by the
  pools' `on_start`, and run under vLLM's forward context.

  Two pools (config/runtime.exs): `:tiny`, one worker; `:tiny_dp`, two workers as DP
  ranks 0 and 1 (`TinyModel.DP`).

      {:ok, out} = TinyModel.forward([1, 2, 3])
      out.next_tokens
      out.context.padded_tokens
  """

  alias TinyModel.Py.TinyLm.ForwardOutput
  alias TinyModel.Py.TinyLm.Module, as: TinyLm
  alias Vllm.Config.VllmConfig
  alias Vllm.ForwardContext.Module, as: FC

  @doc """
  Runs the model on `token_ids` in one worker of pool `:tiny`, under
  `set_forward_context` (no data parallelism).

  Options: `:pool` (default `:tiny`), `:attn_metadata` (a map by layer name, `%{"layers.0"
  => %{"scale" => 0.5}}`, default `nil`), `:batch_descriptor` (a
  `%Vllm.ForwardContext.BatchDescriptor{}`, the size to pad to, default `nil`),
  `:cudagraph_runtime_mode` (default `:none`).
  """
  @spec forward([integer()], keyword()) ::
          {:ok, ForwardOutput.t()} | {:error, VllmBridge.Error.t()}
  def forward(token_ids, opts \\ []) do
    context_opts = [
      num_tokens: length(token_ids),
      cudagraph_runtime_mode: Keyword.get(opts, :cudagraph_runtime_mode, :none),
      batch_descriptor: Keyword.get(opts, :batch_descriptor),
      __runtime__: [pool_name: Keyword.get(opts, :pool, :tiny), timeout_profile: :ml_inference]
    ]

    run_in_context(Keyword.get(opts, :attn_metadata), %VllmConfig{}, context_opts, token_ids)
  end

  @doc false
  # Enters set_forward_context (in the session of context_opts' __runtime__, else a
  # temporary one), runs tiny_lm.forward in that session, and always exits. The forward's
  # own error (a bad token) is the result, as an error entering the context is.
  @spec run_in_context(term(), VllmConfig.t(), keyword(), [integer()]) ::
          {:ok, ForwardOutput.t()} | {:error, VllmBridge.Error.t()}
  def run_in_context(attn_metadata, config, context_opts, token_ids) do
    case FC.with_set_forward_context(attn_metadata, config, 0, context_opts, fn _ ->
           TinyLm.forward(token_ids)
         end) do
      {:ok, {:ok, out}} -> {:ok, out}
      {:ok, {:error, e}} -> {:error, e}
      {:error, e} -> {:error, e}
    end
  end

  @doc """
  The model every worker of `pool` holds, in worker order (one call on each worker:
  `VllmBridge.call_all/5`).
  """
  @spec model_infos(atom()) ::
          {:ok, [TinyModel.Py.TinyLm.ModelInfo.t()]} | {:error, VllmBridge.Error.t()}
  def model_infos(pool \\ :tiny),
    do: VllmBridge.call_all(pool, {"tiny_lm", "model_info"}, [], %{}, [])
end
