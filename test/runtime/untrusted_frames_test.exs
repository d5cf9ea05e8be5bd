defmodule VllmBridge.Runtime.UntrustedFramesTest do
  @moduledoc """
  What a worker's Python process sends is untrusted (it runs user code): frames the
  worker's own encoder never writes, handed to the worker process's routing as they
  would come from the port.

    * a stray frame is logged by its kind, id, size and first bytes, never printed whole
      (a big integer takes quadratic time to print).
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import ExUnit.CaptureLog

  alias VllmBridge.Worker
  alias VllmBridge.Worker.Calls

  # A worker process's state, enough for routing frames (VllmBridge.Worker.route/2).
  defp state(calls \\ Calls.new(nil, 0)),
    do: %{pool: nil, index: nil, os_pid: 4242, loans: nil, calls: calls}

  describe "stray frames are logged by their head" do
    test "a stray frame holding a large big integer is logged by kind, id, size and first bytes" do
      mag = :binary.copy(<<0xFF>>, 100_000)
      bin = <<0x93, 0xA4, "oops", 0xCD, 777::16, 0xC9, 100_001::32, 7, 0, mag::binary>>

      log = capture_log(fn -> Worker.route(state(), bin) end)
      assert log =~ "frame without a call to answer"
      assert log =~ "#{byte_size(bin)} bytes"
      assert log =~ "93a46f6f7073cd0309"
      assert byte_size(log) < 1_000

      # A reply to no call: its kind and id.
      log = capture_log(fn -> Worker.route(state(), <<0x93, 0xA2, "ok", 0xC0, 0xC0>>) end)
      assert log =~ "frame without a call to answer (ok, no id; 6 bytes: 93a26f6bc0c0)"
    end
  end
end
