defmodule TinyModel.DP do
  @moduledoc """
  The model on a DP pair: pool `:tiny_dp`'s workers are DP ranks 0 and 1
  (`TinyModel.Ranks`). `open/1` pins a session to each rank and joins them in a
  `torch.distributed` group (gloo); `forward/3` runs one step on every rank at once, each
  under `set_forward_context` with its own token count, so the ranks agree on their
  counts (one all_reduce on entry) and the model pads to the largest; `close/1` leaves.

      {:ok, dp} = TinyModel.DP.open()
      {:ok, [out0, out1]} = TinyModel.DP.forward(dp, [[1, 2, 3], [4, 5]])
      out1.context.num_tokens_across_dp  #=> [3, 2]
      TinyModel.DP.close(dp)
  """

  alias TinyModel.Py.TinyLm.ForwardOutput
  alias Vllm.Config.{ParallelConfig, VllmConfig}
  alias Vllm.Dp.Module, as: Dp
  alias VllmBridge.{Error, Pool, Session}

  @enforce_keys [:pool, :sessions]
  defstruct [:pool, :sessions]

  @typedoc "A joined DP pair: its pool and one session per rank, by rank."
  @type t :: %__MODULE__{pool: atom(), sessions: [Session.t()]}

  # A collective waits for every rank; one rank's error must not leave the other waiting
  # past this.
  @step_timeout_ms 120_000

  @doc "Opens a session on every worker of `pool` (rank = worker index) and joins the DP group."
  @spec open(atom()) :: {:ok, t()} | {:error, Error.t()}
  def open(pool \\ :tiny_dp) do
    with {:ok, workers} <- Pool.workers(pool),
         {:ok, sessions} <- open_sessions(pool, length(workers)) do
      dp = %__MODULE__{pool: pool, sessions: sessions}

      case on_every_rank(dp, fn _rank, rt -> Dp.init_dp_group(__runtime__: rt) end) do
        {:ok, _infos} ->
          {:ok, dp}

        {:error, e} ->
          Enum.each(sessions, &Session.close/1)
          {:error, e}
      end
    end
  end

  defp open_sessions(pool, size) do
    Enum.reduce_while(0..(size - 1), {:ok, []}, fn rank, {:ok, acc} ->
      case Session.open(pool_name: pool, worker: rank) do
        {:ok, s} ->
          {:cont, {:ok, acc ++ [s]}}

        {:error, e} ->
          Enum.each(acc, &Session.close/1)
          {:halt, {:error, e}}
      end
    end)
  end

  @doc """
  Runs the model on every rank at once, rank `r` on `Enum.at(tokens_by_rank, r)`, each
  under `set_forward_context` with DP on (`num_tokens` its count; the counts across the
  ranks are agreed on entry). Returns the outputs by rank, or the first rank's error.
  `opts` as for `TinyModel.forward/2` (`:attn_metadata`, `:batch_descriptor`,
  `:cudagraph_runtime_mode`).
  """
  @spec forward(t(), [[integer()]], keyword()) ::
          {:ok, [ForwardOutput.t()]} | {:error, Error.t()}
  def forward(%__MODULE__{sessions: sessions} = dp, tokens_by_rank, opts \\ [])
      when is_list(tokens_by_rank) do
    if length(tokens_by_rank) != length(sessions) do
      {:error,
       Error.new(
         :bad_argument,
         "tokens_by_rank must have one token list per rank (#{length(sessions)}), " <>
           "got #{length(tokens_by_rank)}"
       )}
    else
      on_every_rank(dp, fn rank, rt ->
        tokens = Enum.at(tokens_by_rank, rank)

        config = %VllmConfig{
          parallel_config: %ParallelConfig{
            data_parallel_size: length(sessions),
            data_parallel_rank: rank
          }
        }

        context_opts = [
          num_tokens: length(tokens),
          cudagraph_runtime_mode: Keyword.get(opts, :cudagraph_runtime_mode, :none),
          batch_descriptor: Keyword.get(opts, :batch_descriptor),
          __runtime__: rt
        ]

        TinyModel.run_in_context(Keyword.get(opts, :attn_metadata), config, context_opts, tokens)
      end)
    end
  end

  @doc "Leaves the DP group on every rank and closes the sessions."
  @spec close(t()) :: :ok
  def close(%__MODULE__{sessions: sessions} = dp) do
    _ = on_every_rank(dp, fn _rank, rt -> Dp.destroy_dp_group(__runtime__: rt) end)
    Enum.each(sessions, &Session.close/1)
    :ok
  end

  # Runs fun.(rank, runtime_opts) for every rank at once, one task each: a collective
  # needs every rank inside the same call. The results by rank, or the first error.
  defp on_every_rank(%__MODULE__{sessions: sessions}, fun) do
    sessions
    |> Enum.with_index()
    |> Enum.map(fn {s, rank} ->
      Task.async(fn -> fun.(rank, session_id: s.id, timeout: @step_timeout_ms) end)
    end)
    |> Task.await_many(@step_timeout_ms + 5_000)
    |> Enum.reduce_while({:ok, []}, fn
      {:ok, value}, {:ok, acc} -> {:cont, {:ok, acc ++ [value]}}
      {:error, e}, _ -> {:halt, {:error, e}}
    end)
  end
end
