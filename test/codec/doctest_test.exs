defmodule VllmBridge.Codec.DoctestTest do
  @moduledoc "The examples in the codec's docs run as written."
  use ExUnit.Case, async: true
  doctest VllmBridge.Codec
end
