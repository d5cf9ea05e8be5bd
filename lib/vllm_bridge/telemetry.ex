defmodule VllmBridge.Telemetry do
  @moduledoc """
  Telemetry events of vllm_bridge, in the `:telemetry` conventions.

  The library cannot depend on hex packages, so it calls `:telemetry` only when the host
  application has it loaded: an app that depends on `:telemetry` receives ordinary events
  (`:telemetry.attach/4` works as usual), and one that does not pays one BIF call per
  request (`enabled?/0`) and builds nothing (bench/results/telemetry-and-status.md,
  "Telemetry", measures it).

  Conventions, as `:telemetry.span/3`'s: a span is `prefix ++ [:start]`, then
  `prefix ++ [:stop]` or `prefix ++ [:exception]`, from the same process and with the
  same `telemetry_span_context` (a reference) in their metadata; the end's metadata
  repeats the start's, and adds its own keys. Times (`duration`, `queue_time`,
  `monotonic_time`, `system_time`, ...) are in `:native` units: convert with
  `System.convert_time_unit/3`. Handlers run in the process that emits the event: the
  caller's for a request, the worker's for its life.

  ## Events

  | event | measurements | metadata | when |
  |---|---|---|---|
  | `[:vllm_bridge, :call, :start]` | `system_time`, `monotonic_time` | `pool`, `request_kind` (`:call`, `:get`, `:enter`, `:exit`, `:release`, `:stream`), `target`, `session_id`, `telemetry_span_context` | a request enters the bridge (`VllmBridge.call/4`, `get/2`, `enter/4`, `exit/3`, `release/2`, and a stream when its enumeration begins); emitted once its route is known (pool and session), timed from its entry |
  | `[:vllm_bridge, :call, :stop]` | `duration`, `monotonic_time`, `queue_time`, `request_bytes`, `reply_bytes`; a stream also `chunks` | the start's, and `worker` (index; nil when it got none), `error` (nil, or the `VllmBridge.Error` type), `python_type` and `error_message` (nil unless it failed); a stream also `halted` | the request returned: `{:ok, _}`, or `{:error, %VllmBridge.Error{}}` (a Python exception, a timeout, a worker exit, a full queue, a request refused before it had a route: no such pool or session, a lost reference); a stream ended, or its consumer stopped reading it (`halted: true`), or its consumer's own reducer raised (the stream stops being read: `:stop`, `halted: true`, not `:exception`) |
  | `[:vllm_bridge, :call, :exception]` | `duration`, `monotonic_time`; a stream also `queue_time`, `request_bytes`, `reply_bytes`, `chunks` | the start's, and `kind`, `reason`, `stacktrace` (what was raised, thrown or exited with), `worker`, and `error`, `python_type`, `error_message` when `reason` is a `VllmBridge.Error` | something was raised in the caller's process: a stream's errors (they are raised during its enumeration, see `VllmBridge.Stream`); a call, get, enter or exit only on a bug, since they return their errors |
  | `[:vllm_bridge, :pool, :queue_full]` | `system_time`, `queue_size` (the pool's bound) | `pool`, `worker` (the index the caller had to wait for; nil for any worker) | a caller found every worker busy and `queue_size` callers already waiting; its call then stops with `error: :queue_full` |
  | `[:vllm_bridge, :worker, :start]` | `system_time`, `duration` (from the port's opening to ready), `handshake_time` (to the hello) | `pool` (nil outside a pool), `index`, `os_pid`, `instance`, `device` (the hello's, e.g. `"cpu"`, `"cuda:0"`), `restarts` (worker processes that ran at this index of the pool before this one) | a worker is ready: its hello came and its `on_start`, if any, returned; again after each restart |
  | `[:vllm_bridge, :worker, :exit]` | `system_time`, `duration` (since its start began), `in_flight` (requests it took with it, each answered `:worker_exit`) | `pool`, `index`, `os_pid`, `instance`, `restarts`, `reason` (a message: the exit status, the kill and why, the failed start's error), `phase` (`:starting`, `:ready`) | its Python process went down unasked (it exited or was killed, `cancel_grace`, a frame over the limit), or its start failed; the pool restarts it |
  | `[:vllm_bridge, :worker, :stop]` | `system_time`, `duration` | as `:exit`'s, `reason` being the process's exit reason (`:shutdown`, `:normal`) | a worker was stopped on purpose: its pool stopped (`VllmBridge.stop_pool/1`, the application stopping) |
  | `[:vllm_bridge, :worker, :progress]` | `elapsed` (native, since the worker's start began) | `pool`, `index`, `stage` (`:launch`, `:waiting` every 2 s, `:handshake`, `:on_start`, `:ready`, `:failed`), `os_pid`, `device` (nil before the hello) | each stage of a worker's start, also on restarts; the same stages reach a pool's `:progress` callback while `start_pool` waits (`VllmBridge.Pool.Options`) |
  | `[:vllm_bridge, :runner, :step, :start \\| :stop \\| :exception]` | start: `system_time`, `monotonic_time`; stop: `duration` (the whole call), `step_time` and `forward_time` (the runner's own, Python side), `num_tokens`, `num_tokens_padded`, `num_reqs`, `moe_chunks` | `session_id`, `rank`; at stop also `cudagraph_mode`, `graph` (`"replay"`, `"emulated"`, `"eager"`), `should_ubatch`, `skipped`, `error` | **demo only (dev and test builds; not in a release of the library):** one step of the demo's model runner (`vllm_bridge.demo.rank.execute_model`), around its call from Elixir (`VllmBridge.Demo.Step`); built with `span/3` |

  Each worker process ends with exactly one of `:exit` and `:stop`. Sizes are bytes:
  `request_bytes` counts the request's encoded fields (session, target, arguments; the
  frame's own header of kind, id and timeout, under 30 bytes, is left out),
  `reply_bytes` the reply frame's body (a stream's: its chunks'), 0 when no reply came
  (a timeout, a worker exit, a request that was never sent).

  Refused before any span starts (no event at all; the error is returned as usual): a bad
  option (resolving the request's options: an unknown option, a bad `timeout`, say), an
  argument that cannot be encoded, and `call_all/4`'s own checks before it sends (its
  options, its target, the pool's existence). Each worker's call of a `call_all/4` that
  passed them is a span of its own.

  Returned errors end a span with `:stop` and the error in its metadata, raised ones with
  `:exception`, as Ecto's and Finch's spans do: a dashboard counts failures by `error` on
  `:stop`, and `:exception` stays what it is elsewhere, a crash in the caller.

  ## Attaching a handler

  In an app with `:telemetry` among its dependencies:

      :telemetry.attach_many(
        "my-app-vllm-bridge",
        [[:vllm_bridge, :call, :stop], [:vllm_bridge, :worker, :exit]],
        &MyApp.Metrics.handle_event/4,
        nil
      )
  """

  # The host app may not have :telemetry at all; the call below is guarded at run time.
  @compile {:no_warn_undefined, :telemetry}

  alias VllmBridge.Telemetry.Span

  @doc """
  Emits `event` with `measurements` and `metadata` when `:telemetry` is loaded, and does
  nothing otherwise.

      iex> VllmBridge.Telemetry.execute([:vllm_bridge, :example], %{count: 1}, %{})
      :ok
  """
  @spec execute([atom()], map(), map()) :: :ok
  def execute(event, measurements, metadata) do
    # `:telemetry` is loaded once anything attached a handler (attaching calls into it);
    # before that no handler could receive the event, so skipping it loses nothing.
    if :erlang.function_exported(:telemetry, :execute, 3) do
      :telemetry.execute(event, measurements, metadata)
    end

    :ok
  end

  @doc "Whether `:telemetry` is loaded, i.e. whether an event could reach a handler."
  @spec enabled?() :: boolean()
  def enabled?, do: :erlang.function_exported(:telemetry, :execute, 3)

  @doc """
  Runs `fun` inside a span `prefix ++ [:start | :stop | :exception]`, as
  `:telemetry.span/3` does, through the same guard: `fun` returns `{result,
  stop_metadata}` or `{result, extra_measurements, stop_metadata}`, and `span/3` returns
  `result`. Something raised, thrown or exited with in `fun` ends the span with
  `:exception` and goes on. A `fun` that returns anything else raises an `ArgumentError`
  naming what it returned, after ending the span with `:exception` (with that error).
  Without `:telemetry` loaded, it runs `fun` and nothing else (a bad return raises
  alike).

      iex> VllmBridge.Telemetry.span([:my_app, :step], %{rank: 0}, fn ->
      ...>   {:done, %{tokens: 8}, %{mode: :eager}}
      ...> end)
      :done
  """
  @spec span([atom()], map(), (() -> {term(), map()} | {term(), map(), map()})) :: term()
  def span(prefix, metadata, fun) when is_list(prefix) and is_map(metadata) do
    if enabled?() do
      span = Span.start(prefix, metadata)

      try do
        fun.()
      catch
        class, reason ->
          Span.exception(span, class, reason, __STACKTRACE__)
          :erlang.raise(class, reason, __STACKTRACE__)
      else
        {result, stop_metadata} when is_map(stop_metadata) ->
          Span.stop(span, %{}, stop_metadata)
          result

        {result, measurements, stop_metadata}
        when is_map(measurements) and is_map(stop_metadata) ->
          Span.stop(span, measurements, stop_metadata)
          result

        other ->
          # The span ends before the error goes on: no :start is left without an end.
          e = bad_return(other)
          {:current_stacktrace, stacktrace} = Process.info(self(), :current_stacktrace)
          Span.exception(span, :error, e, stacktrace)
          raise e
      end
    else
      case fun.() do
        {result, stop_metadata} when is_map(stop_metadata) -> result
        {result, m, stop_metadata} when is_map(m) and is_map(stop_metadata) -> result
        other -> raise bad_return(other)
      end
    end
  end

  defp bad_return(other) do
    ArgumentError.exception(
      "VllmBridge.Telemetry.span/3: the function must return {result, stop_metadata} or " <>
        "{result, measurements, stop_metadata} (maps), got: #{inspect(other)}"
    )
  end
end
