defmodule VllmBridge.Object do
  @moduledoc """
  A Python dataclass value (msgpack ext 4 of docs/PROTOCOL.md) whose class has no
  registered Elixir struct (see `VllmBridge.Codec.Registry`).

  `fields` maps field names (strings, as in Python: any other is refused when the value
  is encoded) to decoded values. `field_order` keeps the order the
  fields arrived in, so that the value encodes back to the very same bytes; fields of the
  map that `field_order` does not list are encoded after those that it does, in key order
  (so an Object built by hand with `field_order: []` encodes its fields sorted by name).
  """

  @enforce_keys [:class]
  defstruct class: nil, fields: %{}, field_order: []

  @type t :: %__MODULE__{
          class: String.t(),
          fields: %{optional(String.t()) => term()},
          field_order: [String.t()]
        }
end
