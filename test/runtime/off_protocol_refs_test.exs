defmodule VllmBridge.Runtime.OffProtocolRefsTest do
  @moduledoc """
  An answer off the protocol (a worker that broke it) is an error, and the references in
  that answer, which nobody will hold, are released, not kept in the worker for ever:
  a stream answered `ok`, an enter answered with something other than
  `[handle, value]`, a release answered with something other than a count. The fake
  worker (test/support/runtime_fake_worker.py, mode `off_protocol`) answers so and
  reports the releases it read.
  """
  use ExUnit.Case, async: true

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Ref, Session}

  defp pool!(name) do
    start_pool!(name,
      size: 1,
      worker_module: "runtime_fake_worker",
      worker_env: [{"PYTHONPATH", support_dir()}, {"FAKE_WORKER_MODE", "off_protocol"}]
    )

    [%{pid: w}] = workers!(name)
    VllmBridge.Worker.hello(w)["instance"]
  end

  # The releases the fake read, each `[session, refs]` with its refs sorted, sorted.
  # (Releases are read in order with the call that asks: a release cast before it is in.)
  defp releases!(pool) do
    {:ok, releases} = VllmBridge.call({"fake", "releases"}, [], %{}, pool_name: pool)
    releases |> Enum.map(fn [session, refs] -> [session, Enum.sort(refs)] end) |> Enum.sort()
  end

  test "a stream answered ok: its references released, each once, by instance" do
    own = pool!(:rt_off_stream)

    assert {:ok, stream} = VllmBridge.stream({"fake", "refs"}, [], %{}, pool_name: :rt_off_stream)
    e = assert_raise Error, fn -> Enum.to_list(stream) end
    assert e.type == :protocol
    assert e.message =~ "answered ok"

    stranger = String.duplicate("ff", 8)

    assert releases!(:rt_off_stream) ==
             Enum.sort([
               [nil, [[own, 5, nil, "object"], [own, 6, nil, "object"]]],
               [nil, [[stranger, 9, nil, "object"]]]
             ])
  end

  test "an enter answered with no handle: the reference in it released in its session" do
    own = pool!(:rt_off_enter)
    {:ok, session} = Session.open(pool_name: :rt_off_enter)

    assert {:error, %Error{type: :protocol, message: msg}} =
             VllmBridge.enter({"fake", "ctx"}, [], %{}, session_id: session.id)

    assert msg =~ "enter answered"
    assert releases!(:rt_off_enter) == [[session.id, [[own, 7, session.id, "object"]]]]
  end

  test "a release answered with no count: the reference in that answer released, once" do
    own = pool!(:rt_off_release)
    ref = %Ref{instance: own, id: 100, session: nil, type: "object"}

    assert {:error, %Error{type: :protocol, message: msg}} =
             VllmBridge.release(ref, pool_name: :rt_off_release)

    assert msg =~ "release answered"

    # Reference 8, from that answer, is released in turn; its own answer (a count) ends it.
    assert releases!(:rt_off_release) ==
             [[nil, [[own, 8, nil, "object"]]], [nil, [[own, 100, nil, "object"]]]]
  end
end
