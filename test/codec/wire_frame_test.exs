defmodule VllmBridge.WireFrameTest do
  @moduledoc """
  Request frames: the 4-byte length, then the body; small ones are one binary; large ones
  keep tensor data uncopied; the size given to request/4 and the frame limit's bound.
  """
  use ExUnit.Case, async: true
  import Bitwise, only: [<<<: 2]

  alias VllmBridge.{Codec, Tensor}
  alias VllmBridge.Call.Wire

  test "a small request is one binary that decodes to the message" do
    {:ok, parts} = Wire.encode_invoke({"vllm_bridge.bridge.diag", "add"}, [1, 2], %{})
    frame = Wire.request("call", 5, [Wire.value(nil), Wire.value(1000) | parts])
    assert is_binary(frame)
    assert <<len::32, body::binary>> = frame
    assert len == byte_size(body) and Wire.body_size(frame) == len

    assert {:ok, ["call", 5, nil, 1000, ["m", "vllm_bridge.bridge.diag", "add"], [1, 2], %{}]} =
             Codec.decode(body)
  end

  test "a large request stays iodata holding the tensor's own binary" do
    data = :binary.copy(<<0, 0, 128, 63>>, 256 * 1024)
    t = Tensor.new(data, :float32, [256 * 1024])
    {:ok, parts} = Wire.encode_invoke({"vllm_bridge.bridge.diag", "echo"}, [t], %{})
    frame = Wire.request("call", 6, [Wire.value(nil), Wire.value(nil) | parts])
    refute is_binary(frame)
    assert Enum.any?(leaves(frame), &:erts_debug.same(&1, data))
    assert <<len::32, body::binary>> = IO.iodata_to_binary(frame)
    assert len == byte_size(body) and Wire.body_size(frame) == len

    assert {:ok, ["call", 6, nil, nil, _target, [^t], %{}]} = Codec.decode(body)
  end

  test "request/4 with the fields' size makes the frame request/3 makes, within the bound" do
    for args <- [[], [1], ["x"], [:binary.copy("y", 70_000)], [%{"a" => [1.5, nil]}]],
        timeout <- [nil, 0, 127, 128, 65_536, 4_294_967_296],
        id <- [0, 127, 255, 65_536, 1 <<< 40] do
      {:ok, parts} = Wire.encode_invoke({"vllm_bridge.bridge.diag", "echo"}, args, %{})
      req = VllmBridge.Call.Request.new("call", pre: [Wire.value("s")], post: parts)
      fields = req.pre ++ [Wire.value(timeout) | req.post]
      frame = Wire.request("call", id, fields)

      assert IO.iodata_to_binary(Wire.request("call", id, fields, IO.iodata_length(fields))) ==
               IO.iodata_to_binary(frame)

      # The bound used before anything is reserved is never below the real size.
      assert Wire.body_size(frame) <= VllmBridge.Call.Request.max_size(req)
      assert Wire.body_size(frame) + 18 >= VllmBridge.Call.Request.max_size(req)
    end
  end

  test "a body longer than the 4-byte length can say is not framed" do
    # request/4 trusts the size it is given: no 4 GiB need exist to ask.
    max = 0xFFFF_FFFF
    head = IO.iodata_length([0x92, Wire.value("call") | Wire.value(9)])

    assert {:ok, frame, ^max} = Wire.frame_request("call", 9, [], max - head)
    assert Wire.body_size(frame) == max
    assert {:too_large, size} = Wire.frame_request("call", 9, [], max - head + 1)
    assert size == max + 1

    for fields_size <- [1 <<< 32, (1 <<< 32) + 100, 1 <<< 40] do
      assert {:too_large, size} = Wire.frame_request("call", 9, [], fields_size)
      assert size == fields_size + head

      assert_raise ArgumentError, ~r/#{size} bytes/, fn ->
        Wire.request("call", 9, [], fields_size)
      end
    end
  end

  # iodata may hold improper lists ([header | binary])
  defp leaves([head | tail]), do: leaves(head) ++ leaves(tail)
  defp leaves([]), do: []
  defp leaves(other), do: [other]
end
