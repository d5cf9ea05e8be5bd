defmodule VllmBridge.Error do
  @moduledoc """
  The error every bridge call returns as `{:error, %VllmBridge.Error{}}`.

  `type` is one of a small closed set:

    * `:timeout` - the call's deadline passed (queueing included)
    * `:worker_exit` - the Python process died while the call was in flight
    * `:python_exception` - Python raised; `python_type` and `traceback` say what
    * `:queue_full` - the pool's queue is full (back-pressure)
    * `:pool_busy` - no worker could take the call under `:strict_fail_fast` affinity
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

  @impl true
  def message(%__MODULE__{type: type, message: msg, python_type: nil}), do: "#{type}: #{msg}"

  def message(%__MODULE__{type: type, message: msg, python_type: py}),
    do: "#{type}: #{py}: #{msg}"
end
