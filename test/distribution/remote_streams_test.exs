defmodule VllmBridge.Distribution.RemoteStreamsTest do
  @moduledoc """
  Streams on a pool of another node (issue 20) keep the local contract of
  `VllmBridge.Stream`: halted early, the reader keeps the references of the chunks it
  read and no others (those on their way are released there, in their session), and the
  halt never waits on the other node.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log
  @moduletag :distributed

  import VllmBridge.RuntimeHelpers
  import VllmBridge.PeerHelpers

  alias VllmBridge.{Pool, Ref, Session, Worker}
  alias VllmBridge.Session.LooseRefs

  @pool :dist_streams
  @support "rt_stream_support"

  # Checked at compile time without starting anything; distribution starts in
  # start_peer!/2.
  if why = VllmBridge.PeerHelpers.unavailable(),
    do: @moduletag(skip: "distributed Erlang cannot start here: #{why}")

  setup_all do
    {peer, b} = start_peer!(:dist_s)
    on_exit(fn -> stop_peer(peer) end)

    start_pool_on!(b, @pool,
      size: 1,
      max_in_flight: 2,
      allow: ["vllm_bridge.bridge.diag", @support],
      worker_env: [python_path([support_dir()])]
    )

    {:ok, [%{pid: w}]} = :erpc.call(b, Pool, :workers, [@pool])
    %{b: b, w: w}
  end

  setup %{b: b} do
    wait_until(fn -> load(b) == 0 end, 30_000, "the peer's worker idle")
    :ok
  end

  defp load(b) do
    {:ok, ws} = :erpc.call(b, Pool, :workers, [@pool])
    ws |> Enum.map(& &1.load) |> Enum.sum()
  end

  # The references the peer's worker holds.
  defp refs(b, w), do: elem(:erpc.call(b, Worker, :ping, [w]), 1)["refs"]

  defp opaques(n, extra \\ []) do
    {:ok, s} = VllmBridge.stream({@support, "opaques"}, [n], %{}, [pool_name: @pool] ++ extra)
    s
  end

  # Runs `fun` in a process that reports its result and then waits for :go to exit.
  defp in_process(fun) do
    parent = self()

    pid =
      spawn(fn ->
        send(parent, {:result, self(), fun.()})
        receive do: (:go -> :ok)
      end)

    assert_receive {:result, ^pid, result}, 30_000
    {pid, result}
  end

  defp exit_process(pid) do
    mon = Process.monitor(pid)
    send(pid, :go)
    assert_receive {:DOWN, ^mon, :process, ^pid, _}, 5_000
  end

  test "a stream stopped early: the reader keeps the one reference it read, no more",
       %{b: b, w: w} do
    base = refs(b, w)
    {pid, [%Ref{node: ^b}]} = in_process(fn -> Enum.take(opaques(50), 1) end)

    # The one it read is its own (on the peer, where its owner's references are kept);
    # the 49 it did not read, on their way or in its mailbox, are gone.
    wait_until(fn -> refs(b, w) == base + 1 end)
    wait_until(fn -> :erpc.call(b, LooseRefs, :count, [pid]) == 1 end)
    exit_process(pid)
    wait_until(fn -> refs(b, w) == base end)
  end

  test "stopped after a few windows, the reader keeps exactly what it read", %{b: b, w: w} do
    base = refs(b, w)

    for n <- [2, 16, 17, 33, 40] do
      {pid, got} = in_process(fn -> Enum.take(opaques(80), n) end)
      assert length(got) == n
      wait_until(fn -> refs(b, w) == base + n end, 30_000, "#{n} references kept")
      # The release of the unread chunks' references reaches the worker before the
      # ledger of the reader's references hears of it (LooseRefs.forget/1 is a cast
      # after the release): it comes down to n, not at once.
      wait_until(
        fn -> :erpc.call(b, LooseRefs, :count, [pid]) == n end,
        30_000,
        "#{n} references on the reader's ledger"
      )

      exit_process(pid)
      wait_until(fn -> refs(b, w) == base end)
    end
  end

  test "in a session, the unread chunks' references are released in it", %{b: b, w: w} do
    base = refs(b, w)
    {:ok, s} = Session.open(pool_name: @pool)
    assert s.node == b

    [%Ref{session: sid} = kept] = Enum.take(opaques(50, session_id: s.id), 1)
    assert sid == s.id
    wait_until(fn -> refs(b, w) == base + 1 end)
    assert {:ok, 0} = VllmBridge.get({kept, "value"}, session_id: s.id)
    :ok = Session.close(s)
    wait_until(fn -> refs(b, w) == base end)
  end

  test "halting does not wait on the other node: it returns while that node is stopped",
       %{b: b, w: w} do
    base = refs(b, w)
    os_pid = beam_os_pid(b)
    parent = self()

    task =
      Task.async(fn ->
        Enum.reduce_while(opaques(50), 0, fn %Ref{}, n ->
          # Stopped between the first chunk and the halt: the halt cannot reach it.
          send(parent, {:stopped, freeze(os_pid, 30_000)})
          {:halt, n + 1}
        end)
      end)

    assert_receive {:stopped, frozen}, 30_000

    try do
      # The halt and the reader's return happened while the peer was stopped (the old
      # halt waited for the peer's answer to a release, up to a minute).
      assert {:ok, 1} = Task.yield(task, 10_000)
      assert frozen?(frozen)
    after
      thaw(frozen)
    end

    # Once it runs again, the 49 unread chunks' references are released there, and the
    # one read with the task that read it, which has exited.
    wait_until(fn -> refs(b, w) == base end)
    wait_until(fn -> load(b) == 0 end)
  end
end
