defmodule VllmBridge.Runtime.LooseRefsTest do
  @moduledoc """
  References brought back by calls made outside any session (they live in the worker's
  default session) belong to the calling process: released when it exits, forgotten when
  released by hand, and never taken from a session that owns its own.
  """
  use ExUnit.Case, async: false
  @pool :rt_loose
  use VllmBridge.StreamContextCase

  alias VllmBridge.Session.LooseRefs

  defp refs(w), do: elem(Worker.ping(w), 1)["refs"]

  # Runs `fun` in a process that reports its result and then waits for :go to exit.
  defp in_process(fun) do
    parent = self()

    pid =
      spawn(fn ->
        send(parent, {:result, self(), fun.()})

        receive do
          :go -> :ok
        end
      end)

    assert_receive {:result, ^pid, result}, 30_000
    {pid, result}
  end

  defp exit_process(pid) do
    mon = Process.monitor(pid)
    send(pid, :go)
    assert_receive {:DOWN, ^mon, :process, ^pid, _}, 5_000
  end

  test "a reference from a call outside any session is released when its caller exits",
       %{w: w} do
    base = refs(w)
    {pid, {:ok, %Ref{session: nil} = ref}} = in_process(fn -> diag("opaque", [7]) end)

    assert refs(w) == base + 1
    assert LooseRefs.count(pid) == 1
    # Other processes may use it while its owner lives.
    assert {:ok, 7} = VllmBridge.get({ref, "value"}, opts())

    exit_process(pid)
    wait_until(fn -> refs(w) == base end)
    assert LooseRefs.count(pid) == 0

    assert {:error, %Error{type: :bad_argument, message: m}} =
             VllmBridge.get({ref, "value"}, opts())

    assert m =~ "released"
  end

  test "one released by hand is forgotten, and released only once", %{w: w} do
    base = refs(w)

    {pid, {ref, released}} =
      in_process(fn ->
        {:ok, ref} = diag("opaque", [1])
        {ref, VllmBridge.release(ref, opts())}
      end)

    assert released == {:ok, 1}
    assert LooseRefs.count(pid) == 0
    assert refs(w) == base
    exit_process(pid)
    assert {:error, %Error{message: m}} = VllmBridge.get({ref, "value"}, opts())
    assert m =~ "released"
  end

  test "references in a stream's chunks belong to the process that read them", %{w: w} do
    base = refs(w)

    {pid, got} =
      in_process(fn ->
        {:ok, s} = VllmBridge.stream({"rt_stream_support", "opaques"}, [3], %{}, opts())

        Enum.to_list(s)
      end)

    assert [%Ref{}, %Ref{}, %Ref{}] = got
    assert LooseRefs.count(pid) == 3
    assert refs(w) == base + 3
    exit_process(pid)
    wait_until(fn -> refs(w) == base end)
  end

  test "exiting a context entered through a loose reference forgets its handle", %{w: w} do
    base = refs(w)

    {pid, counts} =
      in_process(fn ->
        {:ok, cm} = diag("recorder", ["loose"])
        {:ok, {h, "loose"}} = VllmBridge.enter({cm, nil}, [], %{}, opts())
        entered = LooseRefs.count(self())
        {:ok, false} = VllmBridge.exit(h, nil, opts())
        {entered, LooseRefs.count(self())}
      end)

    # The manager and the handle, then the manager alone.
    assert counts == {2, 1}
    assert refs(w) == base + 1
    exit_process(pid)
    wait_until(fn -> refs(w) == base end)
    assert [%{"name" => "loose", "type" => nil}] = exit_log()
  end

  test "a worker that restarted does not keep the references on the others from going" do
    pool = :rt_loose_two
    start_pool!(pool, size: 2, max_in_flight: 1, allow: ["vllm_bridge.bridge.diag"])
    {ws, _meta} = await_idle!(pool)
    [s0, s1] = for i <- 0..1, do: elem(Session.open(pool_name: pool, worker: i), 1)
    o = [pool_name: pool]
    count = &refs(Enum.at(ws, &1).pid)
    bases = {count.(0), count.(1)}

    # One reference on each worker: the other one is held busy while the owner calls.
    # Back to idle before the next hold: hold/1 waits for the pool's load to go up, which
    # a cancelled hold's slot coming back at that moment would hide.
    on = fn busy, owner ->
      held = hold(o ++ [session_id: busy.id])
      send(owner, :call)
      assert_receive {:called, ^owner, {:ok, %Ref{} = ref}}, 30_000
      unhold(held)
      await_idle!(pool)
      ref
    end

    me = self()

    owner =
      spawn(fn ->
        for _ <- 1..2 do
          receive do:
                    (:call ->
                       send(
                         me,
                         {:called, self(),
                          VllmBridge.call({"vllm_bridge.bridge.diag", "opaque"}, [], %{}, o)}
                       ))
        end

        receive do: (:go -> :ok)
      end)

    r0 = on.(s1, owner)
    r1 = on.(s0, owner)
    assert {r0.instance, r1.instance} == {Enum.at(ws, 0).instance, Enum.at(ws, 1).instance}
    assert {count.(0), count.(1)} == {elem(bases, 0) + 1, elem(bases, 1) + 1}

    # The Python process of the worker whose references would be released first dies (and
    # restarts: its reference went with it); then the owner.
    lost = if r0.instance < r1.instance, do: 0, else: 1
    kept = 1 - lost
    System.cmd("kill", ["-9", "#{Enum.at(ws, lost).os_pid}"])

    gone = Enum.at(ws, lost).instance

    wait_until(fn ->
      {:ok, now} = Pool.workers(pool)
      match?(%{instance: i} when i != gone, Enum.at(now, lost))
    end)

    exit_process(owner)
    wait_until(fn -> count.(kept) == elem(bases, kept) end)
    Enum.each([s0, s1], &Session.close/1)
  end

  test "a loose reference is used and released in its own session, also inside with_session",
       %{w: w} do
    base = refs(w)
    {:ok, ref} = diag("opaque", [5])

    VllmBridge.with_session(
      fn s ->
        # The current session, not named by these calls, does not capture the reference.
        assert {:ok, 5} = VllmBridge.get({ref, "value"}, opts())
        # Naming another session still is an error, by name.
        assert {:error, %Error{type: :bad_argument, message: m}} =
                 VllmBridge.get({ref, "value"}, opts(session_id: s.id))

        assert m =~ "belongs to session nil, not to session #{inspect(s.id)}"
        assert {:ok, 1} = VllmBridge.release(ref, opts())
      end,
      pool_name: @pool
    )

    assert LooseRefs.count(self()) == 0
    assert refs(w) == base
  end

  test "a call that timed out: the references of its late reply are released", %{w: w, meta: meta} do
    base = refs(w)

    assert {:error, %Error{type: :timeout}} =
             VllmBridge.call({"rt_stream_support", "slow_opaque"}, [0.3], %{}, opts(timeout: 100))

    wait_until(fn -> worker_idle?(w, meta) end)
    wait_until(fn -> refs(w) == base end)
  end

  test "a call in a session that timed out: its late reply's references go, the session's stay",
       %{w: w, meta: meta} do
    base = refs(w)
    s = session!()
    {:ok, %Ref{} = kept} = diag("opaque", [7], session_id: s.id)

    assert {:error, %Error{type: :timeout}} =
             VllmBridge.call(
               {"rt_stream_support", "slow_opaque"},
               [0.3],
               %{},
               opts(timeout: 100, session_id: s.id)
             )

    wait_until(fn -> worker_idle?(w, meta) end)
    # Released in the session while it is open (before: held until it closed).
    wait_until(fn -> refs(w) == base + 1 end)
    assert {:ok, 7} = VllmBridge.get({kept, "value"}, opts(session_id: s.id))
    :ok = Session.close(s)
    wait_until(fn -> refs(w) == base end)
  end

  test "a stream stopped early: references in the chunks it did not read are released",
       %{w: w} do
    base = refs(w)

    {pid, [%Ref{}]} =
      in_process(fn ->
        {:ok, s} = VllmBridge.stream({"rt_stream_support", "opaques"}, [50], %{}, opts())
        Enum.take(s, 1)
      end)

    # The one it read is its own; the 49 it did not are gone.
    wait_until(fn -> refs(w) == base + 1 end)
    assert LooseRefs.count(pid) == 1
    exit_process(pid)
    wait_until(fn -> refs(w) == base end)
  end

  test "a stream in a session stopped early: its unread chunks' references go, the session stays",
       %{w: w} do
    base = refs(w)
    s = session!()

    {:ok, st} =
      VllmBridge.stream({"rt_stream_support", "opaques"}, [50], %{}, opts(session_id: s.id))

    [%Ref{session: sid} = kept] = Enum.take(st, 1)
    assert sid == s.id
    # The one it read stays the session's; the 49 it did not are released in it.
    wait_until(fn -> refs(w) == base + 1 end)
    assert {:ok, 0} = VllmBridge.get({kept, "value"}, opts(session_id: s.id))
    :ok = Session.close(s)
    wait_until(fn -> refs(w) == base end)
  end

  test "a session's references stay the session's: the calling process does not own them",
       %{w: w} do
    base = refs(w)
    s = session!()
    {pid, {:ok, %Ref{session: id}}} = in_process(fn -> diag("opaque", [2], session_id: s.id) end)

    assert id == s.id
    assert LooseRefs.count(pid) == 0
    exit_process(pid)
    # Still held: the session (owned by this test process) is open.
    assert refs(w) == base + 1
    :ok = Session.close(s)
    wait_until(fn -> refs(w) == base end)
  end

  test "a release in flight is named by how many references it releases, not by them",
       %{w: w, meta: meta} do
    refs = for i <- 1..3, do: elem(diag("opaque", [i]), 1)
    # A call that runs until its caller dies; the release waits behind it.
    busy = spawn(fn -> diag("sleep", [60], timeout: 120_000) end)
    wait_until(fn -> running?(w) end)

    assert {:error, %Error{type: :timeout, message: m}} =
             VllmBridge.release(refs, opts(timeout: 50))

    assert m =~ "release of 3 reference(s): "

    # What the worker process keeps of it meanwhile (and what its message carried).
    entries = Map.values(:sys.get_state(w).calls.map)

    assert Enum.any?(
             entries,
             &match?(%VllmBridge.Worker.Calls.Entry{what: {"release", "of 3 reference(s)"}}, &1)
           )

    Process.exit(busy, :kill)
    wait_until(fn -> worker_idle?(w, meta) end)
    assert {:error, %Error{type: :bad_argument}} = VllmBridge.get({hd(refs), "value"}, opts())
  end
end
