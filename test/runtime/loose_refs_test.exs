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
end
