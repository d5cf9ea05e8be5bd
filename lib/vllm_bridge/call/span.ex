defmodule VllmBridge.Call.Span do
  @moduledoc false
  # The `[:vllm_bridge, :call]` span of one request (VllmBridge.Call.Run for calls, gets,
  # enters, exits and releases; VllmBridge.Stream for streams): its metadata and
  # measurements, as VllmBridge.Telemetry documents them. Built only when
  # `VllmBridge.Telemetry.enabled?/0`.

  alias VllmBridge.Call.{Route, Runtime}
  alias VllmBridge.Telemetry.Span

  @prefix [:vllm_bridge, :call]

  @doc """
  Starts the span of a request of `kind` for `what` begun at `start` / `system_time`
  (native): metadata `pool`, `request_kind`, `target`, `session_id` (not `kind`: the
  `:exception` event's metadata has that key for the class of what was raised). `route` is nil for a request
  refused before it had one (then the pool and session are those the options named).
  """
  @spec start(String.t(), term(), Route.t() | nil, Runtime.t(), integer(), integer()) ::
          Span.t()
  def start(kind, what, route, rt, start, system_time) do
    Span.start(
      @prefix,
      %{
        pool: pool(route, rt),
        request_kind: kind(kind),
        target: what,
        session_id: session(route, rt)
      },
      start,
      system_time
    )
  end

  @doc """
  Ends the span of a request that returned `result`: `measurements` (`queue_time`,
  native, `request_bytes`, `reply_bytes`, ...) beside the duration; metadata `worker`
  (its index, nil when it got none), the error fields
  (`VllmBridge.Telemetry.Span.error_fields/1`) and `metadata`.
  """
  @spec stop(Span.t(), term(), non_neg_integer() | nil, map(), map()) :: :ok
  def stop(span, result, worker, measurements, metadata \\ %{}) do
    Span.stop(
      span,
      measurements,
      result |> Span.error_fields() |> Map.put(:worker, worker) |> Map.merge(metadata)
    )
  end

  @doc """
  Ends the span with `:exception` (something raised, thrown or exited with in the
  caller's process); `worker` as in `stop/5`; the error fields when `reason` is a
  `VllmBridge.Error` (a stream's errors raise).
  """
  @spec exception(
          Span.t(),
          atom(),
          term(),
          Exception.stacktrace(),
          non_neg_integer() | nil,
          map()
        ) ::
          :ok
  def exception(span, class, reason, stacktrace, worker \\ nil, measurements \\ %{}) do
    Span.exception(
      span,
      class,
      reason,
      stacktrace,
      measurements,
      Map.put(Span.error_fields(reason), :worker, worker)
    )
  end

  defp pool(%Route{meta: meta}, _rt), do: meta.name
  defp pool(nil, %Runtime{pool_name: pool}), do: pool

  defp session(%Route{session_id: id}, _rt), do: id
  defp session(nil, %Runtime{session_id: id}), do: id

  # The wire's kinds as atoms (a closed set: no atom is made from data).
  defp kind("call"), do: :call
  defp kind("get"), do: :get
  defp kind("enter"), do: :enter
  defp kind("exit"), do: :exit
  defp kind("release"), do: :release
  defp kind("stream"), do: :stream
end
