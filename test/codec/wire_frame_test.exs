defmodule VllmBridge.WireFrameTest do
  @moduledoc "Request frames: small ones are one binary; large ones keep tensor data uncopied."
  use ExUnit.Case, async: true

  alias VllmBridge.{Codec, Tensor, Wire}

  test "a small request is one binary that decodes to the message" do
    {:ok, parts} = Wire.encode_invoke({"vllm_bridge.diag", "add"}, [1, 2], %{})
    frame = Wire.request("call", 5, [Wire.value(nil), Wire.value(1000) | parts])
    assert is_binary(frame)

    assert {:ok, ["call", 5, nil, 1000, ["m", "vllm_bridge.diag", "add"], [1, 2], %{}]} =
             Codec.decode(frame)
  end

  test "a large request stays iodata holding the tensor's own binary" do
    data = :binary.copy(<<0, 0, 128, 63>>, 256 * 1024)
    t = Tensor.new(data, :float32, [256 * 1024])
    {:ok, parts} = Wire.encode_invoke({"vllm_bridge.diag", "echo"}, [t], %{})
    frame = Wire.request("call", 6, [Wire.value(nil), Wire.value(nil) | parts])
    refute is_binary(frame)
    assert Enum.any?(leaves(frame), &:erts_debug.same(&1, data))

    assert {:ok, ["call", 6, nil, nil, _target, [^t], %{}]} =
             Codec.decode(IO.iodata_to_binary(frame))
  end

  # iodata may hold improper lists ([header | binary])
  defp leaves([head | tail]), do: leaves(head) ++ leaves(tail)
  defp leaves([]), do: []
  defp leaves(other), do: [other]
end
