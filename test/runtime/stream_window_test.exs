defmodule VllmBridge.Runtime.StreamWindowTest do
  @moduledoc """
  A stream keeps to the window its worker announced in its hello (`stream_window`), not
  to a number of its own: the fake worker (test/support/runtime_fake_worker.py, mode
  `window`) announces a window of 4 and never sends more than that ahead of the credits
  it has read, so a reader that gave room back for another window would stall it.
  """
  use ExUnit.Case, async: true

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Error

  defp windowed_pool!(name, window) do
    start_pool!(name,
      size: 1,
      worker_module: "runtime_fake_worker",
      worker_env: [
        {"PYTHONPATH", support_dir()},
        {"FAKE_WORKER_MODE", "window"},
        {"FAKE_WORKER_WINDOW", Integer.to_string(window)},
        {"FAKE_WORKER_CHUNKS", "20"}
      ]
    )
  end

  for window <- [2, 4, 7] do
    test "a window of #{window}: every chunk arrives and each credit is half of it" do
      pool = windowed_pool!(:"rt_window_#{unquote(window)}", unquote(window))
      [%{pid: w}] = workers!(pool)
      assert VllmBridge.Worker.hello(w)["stream_window"] == unquote(window)

      assert {:ok, stream} =
               VllmBridge.stream({"fake", "count"}, [], %{}, pool_name: pool, timeout: 20_000)

      {values, [credits]} = stream |> Enum.to_list() |> Enum.split(20)
      assert values == Enum.to_list(0..19)
      # The fake had to wait for room (20 chunks, a window far smaller), and each credit it
      # read gave back half the announced window.
      assert credits != []
      assert Enum.all?(credits, &(&1 == div(unquote(window), 2)))
    end
  end

  test "a hello whose stream_window is not an integer of at least 2 is refused" do
    assert {:error, %Error{type: :protocol, message: msg}} =
             VllmBridge.Worker.Hello.check(
               VllmBridge.Codec.encode([
                 "hello",
                 %{"protocol" => 1, "pid" => 1, "instance" => "00", "stream_window" => 1}
               ])
               |> IO.iodata_to_binary(),
               1_048_576
             )

    assert msg =~ "stream_window 1"
  end
end
