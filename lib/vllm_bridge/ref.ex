defmodule VllmBridge.Ref do
  @moduledoc """
  A reference to a Python object that lives in a worker (msgpack ext 6 of
  docs/PROTOCOL.md).

    * `instance` - the worker process's handshake instance (16 hex digits); a reference
      from an earlier process of the same worker is refused with `:session_lost`
    * `id` - the reference's number, unique within that process
    * `session` - the owning session, `nil` for the worker's default session
    * `type` - the object's qualified Python class name (informational)
  """

  @enforce_keys [:instance, :id]
  defstruct [:instance, :id, session: nil, type: ""]

  @type t :: %__MODULE__{
          instance: String.t(),
          id: integer(),
          session: String.t() | nil,
          type: String.t()
        }
end
