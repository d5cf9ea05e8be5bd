defmodule VllmBridge.Bytes do
  @moduledoc """
  Wraps a binary that must travel as msgpack bin (Python `bytes`) even when it happens to
  be valid UTF-8; a bare binary travels as str when it is valid UTF-8.

  One way only: a bin decodes to a bare binary, as a str does. Wrapping also skips the
  UTF-8 scan of the data, which is worth it for large payloads.
  """

  @enforce_keys [:data]
  defstruct [:data]

  @type t :: %__MODULE__{data: binary()}

  @doc "Wraps `data`."
  @spec new(binary()) :: t()
  def new(data) when is_binary(data), do: %__MODULE__{data: data}
end
