defmodule VllmBridge.Telemetry.Span do
  @moduledoc false
  # A span in the shapes of `:telemetry.span/3`, built from `VllmBridge.Telemetry.execute/3`
  # (the library cannot call `:telemetry.span/3`: it must work without `:telemetry`, and
  # its spans learn their stop measurements, queue time and bytes, along the way):
  #
  #   * `prefix ++ [:start]`: `%{monotonic_time, system_time}`, the metadata and a
  #     `telemetry_span_context` (a fresh reference that pairs start and end);
  #   * `prefix ++ [:stop]`: `%{duration, monotonic_time}` and the extra measurements,
  #     the start metadata with the stop's merged over it;
  #   * `prefix ++ [:exception]`: the same, with `kind`, `reason` and `stacktrace`.
  #
  # Times are native units (`System.monotonic_time/0`). Only the enabled path builds a
  # span: callers check `VllmBridge.Telemetry.enabled?/0` first.

  alias VllmBridge.Telemetry

  @enforce_keys [:prefix, :start, :metadata]
  defstruct [:prefix, :start, :metadata]

  @type t :: %__MODULE__{prefix: [atom()], start: integer(), metadata: map()}

  @doc """
  Emits the start of a span begun at `start` (monotonic, native) and `system_time`
  (native); the span to end with `stop/3` or `exception/5`.
  """
  @spec start([atom()], map(), integer(), integer()) :: t()
  def start(
        prefix,
        metadata,
        start \\ System.monotonic_time(),
        system_time \\ System.system_time()
      ) do
    metadata = Map.put(metadata, :telemetry_span_context, make_ref())

    Telemetry.execute(
      prefix ++ [:start],
      %{monotonic_time: start, system_time: system_time},
      metadata
    )

    %__MODULE__{prefix: prefix, start: start, metadata: metadata}
  end

  @doc "Ends `span` with `:stop`: `measurements` beside the duration, `metadata` over the start's."
  @spec stop(t(), map(), map()) :: :ok
  def stop(%__MODULE__{} = span, measurements, metadata) do
    now = System.monotonic_time()

    Telemetry.execute(
      span.prefix ++ [:stop],
      Map.merge(measurements, %{duration: now - span.start, monotonic_time: now}),
      Map.merge(span.metadata, metadata)
    )
  end

  @doc """
  Ends `span` with `:exception`: the `kind`, `reason` and `stacktrace` of what was raised,
  thrown or exited with, and `metadata` (and `measurements`) as `stop/3`'s.
  """
  @spec exception(t(), :error | :exit | :throw, term(), Exception.stacktrace(), map(), map()) ::
          :ok
  def exception(
        %__MODULE__{} = span,
        kind,
        reason,
        stacktrace,
        measurements \\ %{},
        metadata \\ %{}
      ) do
    now = System.monotonic_time()

    Telemetry.execute(
      span.prefix ++ [:exception],
      Map.merge(measurements, %{duration: now - span.start, monotonic_time: now}),
      span.metadata
      |> Map.merge(metadata)
      |> Map.merge(%{kind: kind, reason: reason, stacktrace: stacktrace})
    )
  end

  @doc """
  The error fields of a stop or exception metadata: `error` (the `VllmBridge.Error`
  type; nil for a success, or for a raised term that is not a `VllmBridge.Error`),
  `python_type` (the Python exception's class, for `:python_exception`) and
  `error_message`.
  """
  @spec error_fields(term()) :: %{
          error: atom() | nil,
          python_type: String.t() | nil,
          error_message: String.t() | nil
        }
  def error_fields({:error, %VllmBridge.Error{} = e}), do: error_fields(e)

  def error_fields(%VllmBridge.Error{type: type, python_type: py, message: message}),
    do: %{error: type, python_type: py, error_message: message}

  def error_fields(_other), do: %{error: nil, python_type: nil, error_message: nil}
end
