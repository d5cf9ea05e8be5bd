defmodule VllmBridge.Runtime.LeanCallTest do
  @moduledoc """
  The lean path of a call outside any session (VllmBridge.Call.Run, taken when
  `:telemetry` is not loaded) answers as the general path (`Run.general/4`) for the same
  requests on real workers: generated values echoed, Python exceptions, unknown
  targets, a pool that is not started, a request over the frame limit, a deadline that
  passes, references adopted by the caller; and it leaves a busy pool's queue to the
  general path, which queues the call until a slot comes back.
  """
  use ExUnit.Case, async: false

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Call.{Run, Runtime, Wire}
  alias VllmBridge.Pool.{Directory, Slots}
  alias VllmBridge.Session.LooseRefs
  alias VllmBridge.TestSupport.TermGen
  alias VllmBridge.{Error, Ref}

  @pool :rt_lean
  @small :rt_lean_small

  setup_all do
    start_pool!(@pool, size: 2, max_in_flight: 4)
    start_pool!(@small, size: 1, max_in_flight: 1, max_frame_bytes: 65_536)
    :ok
  end

  # The same request through both paths: the lean one (what Run.run/4 runs without
  # :telemetry; called directly, since another test may have loaded it) and the general
  # one.
  defp both(target, args, opts) do
    {:ok, rt} = Runtime.resolve(opts)
    {:ok, parts} = Wire.encode_invoke(target, args, %{})
    run_opts = [what: target, bound: nil, payload: {args, %{}}]
    lean = Run.plain(rt, "call", parts, run_opts)
    {:ok, rt} = Runtime.resolve(opts)
    general = Run.general(rt, "call", parts, run_opts)
    {normal(lean), normal(general)}
  end

  # A call on the lean path alone.
  defp lean(target, args, opts) do
    {:ok, rt} = Runtime.resolve(opts)
    {:ok, parts} = Wire.encode_invoke(target, args, %{})
    Run.plain(rt, "call", parts, what: target, bound: nil, payload: {args, %{}})
  end

  # Errors compared by type and message, request ids (which differ) left out.
  defp normal({:error, %Error{type: type, message: message}}),
    do: {:error, type, String.replace(message, ~r/\d+/, "N")}

  defp normal(other), do: other

  defp value do
    TermGen.nested(Enum.random(0..2),
      leaf: fn ->
        Enum.random([
          fn -> TermGen.integer() end,
          fn -> TermGen.float() end,
          fn -> TermGen.string([0, 1, 40]) end,
          fn -> TermGen.bytes([0, 5]) end,
          fn -> Enum.random([nil, true, false, :nan]) end
        ]).()
      end,
      key: fn -> TermGen.string([1, 5]) end
    )
  end

  test "generated calls answer alike on both paths" do
    seed = :erlang.phash2(make_ref())
    :rand.seed(:exsss, {seed, 19, 6})

    for _ <- 1..300 do
      {target, args} =
        Enum.random([
          {{"vllm_bridge.bridge.diag", "echo"}, [value()]},
          {{"vllm_bridge.bridge.diag", "add"}, [TermGen.integer(), Enum.random([1, "x"])]},
          {{"vllm_bridge.bridge.diag", "fail"}, [TermGen.string([1, 8])]},
          {{"vllm_bridge.bridge.diag", "no_such_function"}, []},
          {{"vllm_bridge.forward_context", "is_forward_context_available"}, []}
        ])

      pool = Enum.random([@pool, @pool, :rt_lean_not_started])
      {lean, general} = both(target, args, pool_name: pool)
      assert lean == general, "seed #{seed}: #{inspect({target, args, pool}, limit: 8)}"
    end
  end

  test "a request over the frame limit is refused alike, nothing reserved" do
    big = String.duplicate("x", 70_000)
    {lean, general} = both({"vllm_bridge.bridge.diag", "echo"}, [big], pool_name: @small)
    assert {:error, :bad_argument, message} = lean
    assert message =~ "max_frame_bytes"
    assert lean == general
    assert total_load(@small) == 0
  end

  test "a deadline that passes answers :timeout alike, naming the call" do
    {lean, general} =
      both({"vllm_bridge.bridge.diag", "sleep"}, [5.0], pool_name: @small, timeout: 50)

    assert {:error, :timeout, message} = lean
    assert message =~ "call vllm_bridge.bridge.diag.sleep"
    assert lean == general
    await_idle!(@small)
  end

  test "references a call brings back belong to the caller on the lean path too" do
    parent = self()

    pid =
      spawn(fn ->
        send(
          parent,
          {:got, lean({"vllm_bridge.bridge.diag", "opaque"}, [3], pool_name: @pool)}
        )

        receive do: (:go -> :ok)
      end)

    assert_receive {:got, {:ok, %Ref{session: nil}}}, 30_000
    assert LooseRefs.count(pid) == 1
    send(pid, :go)
  end

  test "with every slot taken the call queues (the general path) and runs once one is free" do
    held = hold(pool_name: @small)
    {:ok, meta} = Directory.pool(@small)

    task =
      Task.async(fn ->
        lean({"vllm_bridge.bridge.diag", "add"}, [1, 2], pool_name: @small)
      end)

    wait_until(fn -> Slots.waiting(meta) == 1 end, 30_000, "the call queued")
    unhold(held)
    assert Task.await(task, 30_000) == {:ok, 3}
  end
end
