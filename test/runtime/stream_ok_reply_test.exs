defmodule VllmBridge.Runtime.StreamOkReplyTest do
  @moduledoc """
  A stream answered `ok` (what a stream never gets: a worker that broke the protocol)
  raises a protocol error, and the references in that value are released, not kept in
  the worker for ever: the fake worker (test/support/runtime_fake_worker.py, mode
  `stream_ok`) answers a stream so, with references of its own instance (one of them
  twice) and one of another instance, and reports the releases it read.
  """
  use ExUnit.Case, async: true

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Error

  test "its references are released, each once, by instance, and the pool stays up" do
    pool =
      start_pool!(:rt_stream_ok,
        size: 1,
        worker_module: "runtime_fake_worker",
        worker_env: [{"PYTHONPATH", support_dir()}, {"FAKE_WORKER_MODE", "stream_ok"}]
      )

    [%{pid: w}] = workers!(pool)
    own = VllmBridge.Worker.hello(w)["instance"]

    assert {:ok, stream} = VllmBridge.stream({"fake", "refs"}, [], %{}, pool_name: pool)
    e = assert_raise Error, fn -> Enum.to_list(stream) end
    assert e.type == :protocol
    assert e.message =~ "answered ok"

    # The releases were cast before the raise; the worker reads its frames in order.
    assert {:ok, releases} = VllmBridge.call({"fake", "releases"}, [], %{}, pool_name: pool)

    stranger = String.duplicate("ff", 8)

    got =
      releases |> Enum.map(fn [session, refs] -> [session, Enum.sort(refs)] end) |> Enum.sort()

    assert got ==
             Enum.sort([
               [nil, [[own, 5, nil, "object"], [own, 6, nil, "object"]]],
               [nil, [[stranger, 9, nil, "object"]]]
             ])
  end
end
