defmodule VllmBridge.Distribution.AbandonedRequestTest do
  @moduledoc """
  A request given up on before the node that serves it started it never runs there,
  even when the node runs again (issue 20, docs/DEPLOYMENT.md "Netsplits"): its spawn
  request, still on the connection, reaches the node late, and the proxy it starts waits
  for the caller's go, which does not come.

  The targets (test/distribution/dist_marks.py) create a file when they start, so the
  tests see whether a request ran at all, whatever became of its answer. Each test first
  lets the peer handle whatever was sent to it before (a later request there answers,
  and no proxy is left: a late one has run or given up by then), then looks for the file.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log
  @moduletag :distributed

  import VllmBridge.RuntimeHelpers
  import VllmBridge.PeerHelpers

  alias VllmBridge.{Error, Remote}

  # Checked at compile time without starting anything; distribution starts in
  # start_peer!/2.
  if why = VllmBridge.PeerHelpers.unavailable(),
    do: @moduletag(skip: "distributed Erlang cannot start here: #{why}")

  @pool :dist_abandoned
  @marks "dist_marks"

  setup_all do
    {peer, b} = start_peer!(:dist_f)
    on_exit(fn -> stop_peer(peer) end)

    start_pool_on!(b, @pool,
      size: 1,
      allow: [@marks],
      worker_env: [python_path([Path.expand(".", __DIR__)])]
    )

    %{b: b}
  end

  setup do
    dir = Path.join(System.tmp_dir!(), "vb_marks_#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf(dir) end)
    %{dir: dir}
  end

  defp mark(path, opts),
    do: VllmBridge.call({@marks, "mark"}, [path], %{}, [pool_name: @pool] ++ opts)

  defp marks_stream(path, opts) do
    {:ok, s} =
      VllmBridge.stream({@marks, "mark_then_count"}, [path, 3], %{}, [pool_name: @pool] ++ opts)

    s
  end

  # The peer has handled what was sent to it before this: a request sent now travels the
  # same connection behind it, and runs (its file shows the target's mark is seen here);
  # then no proxy is left there, so a late one has either run its request or given up.
  defp settled(b, dir) do
    witness = Path.join(dir, "witness-#{System.unique_integer([:positive])}")
    assert {:ok, ^witness} = mark(witness, timeout: 30_000)
    assert File.exists?(witness)
    wait_until(fn -> proxies_on(b) == [] end, 30_000, "no proxy left on the peer")
  end

  test "a call given up on while its node is stopped never runs there", %{b: b, dir: dir} do
    late = Path.join(dir, "late-call")

    {result, stopped?} = while_frozen(b, fn -> mark(late, timeout: 300) end)

    assert stopped?, "the call answered only once the peer ran again"
    assert {:error, %Error{type: :timeout, message: m}} = result
    assert m =~ "on node #{inspect(b)}" and m =~ "will not run there", m

    settled(b, dir)
    refute File.exists?(late), "the abandoned call ran on the peer once it ran again"
  end

  # Given up on at its per-chunk timeout (its first chunk not come) or at its
  # stream_timeout: the proxy's spawn is given up on at the first of the two.
  test "a stream given up on while its node is stopped never starts there", %{b: b, dir: dir} do
    for {opts, i} <- Enum.with_index([[timeout: 300], [stream_timeout: 300]]) do
      late = Path.join(dir, "late-stream-#{i}")

      {result, stopped?} =
        while_frozen(b, fn ->
          try do
            Enum.to_list(marks_stream(late, opts))
          rescue
            e in Error -> e
          end
        end)

      assert stopped?, "#{inspect(opts)}: the stream answered only once the peer ran again"
      assert %Error{type: :timeout, message: m} = result
      assert m =~ "on node #{inspect(b)}" and m =~ "will not run there", m
      assert m =~ "within its first chunk's time", m

      settled(b, dir)
      refute File.exists?(late), "#{inspect(opts)}: the abandoned stream started on the peer"
    end

    # The pool serves streams as before.
    again = Path.join(dir, "again")
    assert Enum.to_list(marks_stream(again, timeout: 30_000)) == [0, 1, 2]
    assert File.exists?(again)
  end

  # The same class without stopping anything: a spawn request that reaches a running node
  # after its caller's give-up time (here, one already past when it is sent) starts a
  # proxy there that is never told to go. One whose give-up time is ahead runs. (A
  # stream's job: a call's carries arguments encoded by the call path.)
  test "a proxy spawned after its caller's give-up time runs nothing; one in time runs",
       %{b: b, dir: dir} do
    late = Path.join(dir, "past-deadline")
    past = System.monotonic_time(:millisecond) - 10 * Remote.settle_margin()
    assert {:error, :timeout} = Remote.spawn_proxy(b, stream_job(late, b), past)
    settled(b, dir)
    refute File.exists?(late), "the proxy spawned past its caller's give-up time ran"

    in_time = Path.join(dir, "in-time")
    ahead = System.monotonic_time(:millisecond) + 30_000
    assert {:ok, {_pid, mref, reply}} = Remote.spawn_proxy(b, stream_job(in_time, b), ahead)
    assert_receive {^reply, :watcher, watcher}, 30_000
    assert_receive {^reply, :chunk, 0}, 30_000
    assert File.exists?(in_time)
    send(watcher, {:halt, 1, :now})
    Remote.done(mref, reply)
  end

  # A stream's job as VllmBridge.Remote.Stream.open/5 makes it.
  defp stream_job(path, b) do
    opts = [pool_name: @pool, node: b, timeout: 30_000, stream_timeout: 30_000]
    {:stream, {@marks, "mark_then_count"}, [path, 3], %{}, opts, nil}
  end
end
