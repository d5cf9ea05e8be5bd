defmodule VllmBridge.Demo.Step do
  @moduledoc """
  One step of the demo's model runner (`vllm_bridge.demo.rank.execute_model`, through its
  generated binding), inside a `[:vllm_bridge, :runner, :step]` telemetry span
  (`VllmBridge.Telemetry.span/3`; documented in `VllmBridge.Telemetry`'s table).

  The runner runs in Python; the span is taken here, around its call, and its stop
  carries the figures of the step's report: the runner's own step and forward times
  (measured in Python, as native time units), tokens real and padded, requests, MoE
  chunks, and the agreed CUDA-graph mode, how the pass ran (`graph`) and whether it was
  micro-batched. `duration - step_time` is what the bridge added to the step.
  """

  alias Vllm.Demo.Rank.Module, as: Runner
  alias VllmBridge.Telemetry

  @event [:vllm_bridge, :runner, :step]

  @doc """
  Runs `step` (`VllmBridge.Demo.Schedule`) with runtime options `rt` (the rank's
  session); `rank` names it in the span's metadata.
  """
  @spec execute(map(), keyword(), non_neg_integer() | nil) ::
          {:ok, map()} | {:error, VllmBridge.Error.t()}
  def execute(step, rt, rank \\ nil) do
    Telemetry.span(@event, %{session_id: rt[:session_id], rank: rank}, fn ->
      result =
        Runner.execute_model(
          step["num_scheduled_tokens"],
          step["new_requests"],
          step["finished"],
          __runtime__: rt
        )

      {result, measurements(result), metadata(result)}
    end)
  end

  defp measurements({:ok, out}) do
    %{
      step_time: native(out["step_ms"]),
      forward_time: native(out["forward_ms"]),
      num_tokens: out["num_tokens"],
      num_tokens_padded: out["num_tokens_padded"],
      num_reqs: out["num_reqs"],
      moe_chunks: out["moe_chunks"]
    }
  end

  defp measurements({:error, _}), do: %{}

  defp metadata({:ok, out}) do
    %{
      cudagraph_mode: out["cudagraph_mode"],
      graph: out["graph"],
      should_ubatch: out["should_ubatch"],
      skipped: out["skipped"],
      error: nil
    }
  end

  defp metadata({:error, e}), do: %{error: e.type}

  defp native(ms) when is_number(ms),
    do: System.convert_time_unit(round(ms * 1_000), :microsecond, :native)
end
