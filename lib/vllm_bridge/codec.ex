defmodule VllmBridge.Codec do
  @moduledoc """
  The bridge's value codec: msgpack plus the extension types of docs/PROTOCOL.md.

  (Walking-skeleton stage: plain msgpack only; extension types arrive with the runtime.)
  """

  alias VllmBridge.Codec.Msgpack

  @doc "Encodes a term to iodata; raises `ArgumentError` naming a value it cannot encode."
  @spec encode(term()) :: iodata()
  def encode(term), do: Msgpack.encode(term)

  @doc "Decodes one whole body; malformed input is `{:error, reason}`, never a raise."
  @spec decode(binary()) :: {:ok, term()} | {:error, String.t()}
  def decode(bin), do: Msgpack.decode(bin)
end
