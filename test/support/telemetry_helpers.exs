defmodule VllmBridge.TelemetryHelpers do
  @moduledoc false
  # Recording the bridge's telemetry events in a test: `load!/0` loads the stand-in
  # `:telemetry` (test/support/telemetry_stand_in.exs), `record/2` attaches a handler
  # that sends each event of a pool to the test process as
  # `{:telemetry_event, event, measurements, metadata}` (other pools' events, from tests
  # running beside it, are not sent), detached when the test ends.

  import ExUnit.Assertions

  # The stand-in is loaded at run time (load!/0).
  @compile {:no_warn_undefined, :telemetry}

  @doc "Loads the stand-in `:telemetry` (once per run)."
  def load! do
    unless :erlang.function_exported(:telemetry, :execute, 3) do
      Code.require_file("telemetry_stand_in.exs", __DIR__)
    end

    true = VllmBridge.Telemetry.enabled?()
    :ok
  end

  @doc """
  Sends every event in `events` whose metadata's `pool` is `pool` (and that
  `filter.(metadata)` accepts) to the calling process, until the test ends.
  """
  def record(pool, events, filter \\ fn _ -> true end) do
    load!()
    id = {__MODULE__, make_ref()}
    test = self()

    :ok =
      :telemetry.attach_many(
        id,
        events,
        fn event, measurements, metadata, _config ->
          if Map.get(metadata, :pool) == pool and filter.(metadata),
            do: send(test, {:telemetry_event, event, measurements, metadata})
        end,
        nil
      )

    ExUnit.Callbacks.on_exit(fn -> :telemetry.detach(id) end)
    id
  end

  @doc "The call span's three events (`[:vllm_bridge, :call, _]`)."
  def call_events,
    do: for(e <- [:start, :stop, :exception], do: [:vllm_bridge, :call, e])

  @doc "The worker's events."
  def worker_events,
    do: for(e <- [:start, :stop, :exit], do: [:vllm_bridge, :worker, e])

  @doc "Receives the next event named `event` (flunks after `ms`): `{measurements, metadata}`."
  def next_event(event, ms \\ 30_000) do
    receive do
      {:telemetry_event, ^event, measurements, metadata} -> {measurements, metadata}
    after
      ms -> flunk("no #{inspect(event)} event within #{ms} ms")
    end
  end

  @doc "Asserts that no event named `event` is waiting in the mailbox."
  def refute_event(event) do
    refute_received {:telemetry_event, ^event, _, _}
  end

  @doc """
  Receives one span (start, then stop or exception, of the same span context):
  `{start_measurements, start_metadata, end, end_measurements, end_metadata}`, `end`
  being `:stop` or `:exception`. Checks what every span must hold: times in native
  units as integers, the end's metadata a superset of the start's.
  """
  def next_span(prefix, ms \\ 30_000) do
    {start_m, start_md} = next_event(prefix ++ [:start], ms)
    ctx = start_md.telemetry_span_context
    assert is_reference(ctx)
    assert is_integer(start_m.monotonic_time) and is_integer(start_m.system_time)

    stop = prefix ++ [:stop]
    exception = prefix ++ [:exception]

    {kind, end_m, end_md} =
      receive do
        {:telemetry_event, ^stop, m, %{telemetry_span_context: ^ctx} = md} ->
          {:stop, m, md}

        {:telemetry_event, ^exception, m, %{telemetry_span_context: ^ctx} = md} ->
          {:exception, m, md}
      after
        ms -> flunk("span #{inspect(prefix)} did not end within #{ms} ms")
      end

    assert is_integer(end_m.duration) and end_m.duration >= 0
    assert is_integer(end_m.monotonic_time)
    assert end_m.monotonic_time - end_m.duration == start_m.monotonic_time

    for {key, value} <- start_md do
      assert Map.fetch(end_md, key) == {:ok, value},
             "the #{kind} metadata repeats the start's #{inspect(key)}"
    end

    {start_m, start_md, kind, end_m, end_md}
  end
end
