defmodule VllmBridge.TestSupport.Unchecked do
  @moduledoc false
  # The protocol's encoder without the map-key check, a `VllmBridge.Codec.Msgpack`
  # handler: the bytes a careless or hostile peer sends. Given a depth budget over the
  # protocol's (`Msgpack.encode(term, Unchecked, 2000)`), without its depth limit too.
  # Shared by test/codec/vectors_test.exs and the runtime tests that send such bytes to a
  # worker (echo_fuzz_test.exs, value_refusal_test.exs).

  def encode_other(term, _h, depth),
    do: VllmBridge.Codec.Ext.encode_other(term, __MODULE__, depth)

  def check_keys(_pairs), do: :ok
end
