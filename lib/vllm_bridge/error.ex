defmodule VllmBridge.Error do
  @moduledoc """
  The error every bridge call returns as `{:error, %VllmBridge.Error{}}`.

  `type` is one of a small closed set:

    * `:timeout` - the call's deadline passed (queueing included)
    * `:worker_exit` - the Python process died while the call was in flight
    * `:python_exception` - Python raised; `python_type` and `traceback` say what
    * `:queue_full` - the pool's queue is full (back-pressure)
    * `:pool_busy` - under `:strict_fail_fast` affinity, the worker the call must run on
      was not idle (running or holding a call, or restarting)
    * `:session_lost` - the session's worker restarted, so its state is gone
    * `:bad_argument` - a value was refused at the boundary (either side)
    * `:protocol` - a frame could not be decoded or broke the protocol
    * `:cancelled` - the call was cancelled before it finished
  """

  @types [
    :timeout,
    :worker_exit,
    :python_exception,
    :queue_full,
    :pool_busy,
    :session_lost,
    :bad_argument,
    :protocol,
    :cancelled
  ]

  defexception type: :protocol, message: "", python_type: nil, traceback: nil, details: %{}

  @type type ::
          :timeout
          | :worker_exit
          | :python_exception
          | :queue_full
          | :pool_busy
          | :session_lost
          | :bad_argument
          | :protocol
          | :cancelled

  @type t :: %__MODULE__{
          type: type(),
          message: String.t(),
          python_type: String.t() | nil,
          traceback: String.t() | nil,
          details: map()
        }

  @doc "The closed set of error types."
  @spec types() :: [type()]
  def types, do: @types

  @doc "Builds an error of `type` with `message` (and optional fields)."
  @spec new(type(), String.t(), keyword()) :: t()
  def new(type, message, fields \\ []) when type in @types and is_binary(message) do
    struct!(__MODULE__, [type: type, message: message] ++ fields)
  end

  @doc """
  Builds the error of an `error` reply from the worker's error map (docs/PROTOCOL.md,
  "Error map"). A `type` outside the closed set becomes `:protocol`, naming it; the
  `exc_id` (when present) is kept in `details` so that a context manager's `exit` can pass
  the real exception back.
  """
  @spec from_wire(term()) :: t()
  def from_wire(%{"type" => type} = map) when is_binary(type) do
    message =
      case map["message"] do
        m when is_binary(m) -> m
        m -> inspect(m, limit: 8, printable_limit: 200)
      end

    details =
      case map["exc_id"] do
        id when is_integer(id) -> %{exc_id: id}
        _ -> %{}
      end

    case wire_type(type) do
      nil ->
        new(:protocol, "the worker answered an unknown error type #{inspect(type)}: #{message}",
          details: Map.put(details, :wire, map)
        )

      atom ->
        new(atom, message,
          python_type: string_or_nil(map["python_type"]),
          traceback: string_or_nil(map["traceback"]),
          details: details
        )
    end
  end

  def from_wire(other),
    do: new(:protocol, "the worker answered a malformed error map: #{inspect(other, limit: 8)}")

  @wire_types Map.new(@types, &{Atom.to_string(&1), &1})
  defp wire_type(name), do: Map.get(@wire_types, name)

  defp string_or_nil(s) when is_binary(s), do: s
  defp string_or_nil(_), do: nil

  @doc """
  The error map a context manager's `exit` carries for this error (docs/PROTOCOL.md,
  "Context managers"): type, message, Python type, and the `exc_id` when the worker
  recorded the exception, so that `__exit__` receives the real one.
  """
  @spec to_wire(t()) :: map()
  def to_wire(%__MODULE__{} = e) do
    %{
      "type" => Atom.to_string(e.type),
      "message" => e.message,
      "python_type" => e.python_type,
      "traceback" => e.traceback,
      "exc_id" => Map.get(e.details, :exc_id)
    }
  end

  @impl true
  def message(%__MODULE__{type: type, message: msg, python_type: nil}), do: "#{type}: #{msg}"

  def message(%__MODULE__{type: type, message: msg, python_type: py}),
    do: "#{type}: #{py}: #{msg}"
end
