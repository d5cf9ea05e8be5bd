defmodule VllmBridge.Runtime.PoolStatusTest do
  @moduledoc """
  `VllmBridge.Pool.status/2` on real workers: every field of an idle pool, a worker
  running a long call (its state, target and growing age, while the call still runs),
  sessions and references held, restarts after a crash, a worker still starting, and the
  errors of a bad request.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Pool
  alias VllmBridge.Pool.Status
  alias VllmBridge.Session

  @pool :rt_status
  @diag "vllm_bridge.bridge.diag"

  setup_all do
    dir = Path.join(System.tmp_dir!(), "rt_status_#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf!(dir) end)

    start_pool!(@pool,
      size: 2,
      allow: [@diag, "rt_gate"],
      worker_env: [python_path([support_dir()])]
    )

    %{dir: dir}
  end

  setup do
    await_idle!(@pool)
    :ok
  end

  defp status!(pool \\ @pool) do
    {:ok, %Status{} = s} = Pool.status(pool)
    s
  end

  defp worker!(index, pool \\ @pool), do: Enum.at(status!(pool).workers, index)

  test "an idle pool: every field" do
    ws = workers!(@pool)
    s = status!()
    assert %Status{pool: @pool, size: 2, waiting: 0} = s
    assert Enum.map(s.workers, & &1.index) == [0, 1]

    for w <- s.workers do
      serving = Enum.find(ws, &(&1.index == w.index))
      assert %Status.Worker{state: :ready, running: nil, in_flight: 0, queued: 0} = w
      assert {w.pid, w.os_pid} == {serving.pid, serving.os_pid}
      assert device?(w.device)
      assert is_integer(w.sessions) and w.refs == 0
      # (The crash test may have run before: counted in its own test.)
      assert is_integer(w.restarts) and w.restarts >= 0
      # Its resident memory, as the kernel counts it: torch alone is tens of MiB.
      assert w.rss_bytes > 10 * 1024 * 1024
      # A CPU worker: no CUDA figures.
      assert {w.cuda_allocated, w.cuda_reserved} == {nil, nil}
    end
  end

  test "concurrent status calls do not see each other's pings" do
    await_idle!(@pool)

    for _round <- 1..10 do
      statuses =
        1..8
        |> Enum.map(fn _ -> Task.async(fn -> status!() end) end)
        |> Task.await_many(60_000)

      for s <- statuses, w <- s.workers do
        assert %Status.Worker{state: :ready, running: nil, in_flight: 0} = w
      end
    end
  end

  test "a long call: :running with its target and a growing age, while the call still runs",
       %{dir: dir} do
    gate = Path.join(dir, "gate-#{System.unique_integer([:positive])}")
    {:ok, session} = Session.open(pool_name: @pool, worker: 1)

    task =
      Task.async(fn ->
        VllmBridge.call({"rt_gate", "wait_for"}, [gate], %{},
          session_id: session.id,
          timeout: 120_000
        )
      end)

    first = wait_until(fn -> (w = worker!(1)).state == :running && w end)
    assert %{kind: "call", target: {"rt_gate", "wait_for"}, age_ms: age} = first.running
    assert is_integer(age) and age >= 0
    assert first.in_flight == 1 and first.queued == 0
    # The other worker is idle meanwhile.
    assert worker!(0).state == :ready

    later = wait_until(fn -> (w = worker!(1)).running.age_ms > age && w end)
    assert later.running.id == first.running.id
    # Both statuses came while the call still ran.
    assert Task.yield(task, 0) == nil

    File.write!(gate, "")
    assert {:ok, _pid} = Task.await(task, 60_000)
    assert wait_until(fn -> worker!(1).state == :ready end)
    Session.close(session)
  end

  test "sessions and references held" do
    before = worker!(0)
    {:ok, session} = Session.open(pool_name: @pool, worker: 0)
    {:ok, ref} = VllmBridge.call({@diag, "opaque"}, [1], %{}, session_id: session.id)
    {:ok, _} = VllmBridge.call({@diag, "opaque"}, [2], %{}, session_id: session.id)
    assert %VllmBridge.Ref{} = ref

    held = worker!(0)
    assert held.refs == before.refs + 2
    assert held.sessions == before.sessions + 1

    :ok = Session.close(session)
    assert wait_until(fn -> worker!(0).refs == before.refs end)
  end

  test "await_ready takes :infinity, and refuses a timeout of another kind by name" do
    assert :ok = Pool.await_ready(@pool, :infinity)

    for bad <- [-1, 1.5, "100", nil] do
      assert {:error, %VllmBridge.Error{type: :bad_argument, message: msg}} =
               Pool.await_ready(@pool, bad)

      assert msg =~ "got #{inspect(bad)}"
    end
  end

  test "restarts are counted per worker after a crash" do
    [w0, _w1] = workers!(@pool)
    before = status!()
    Pool.await_ready(@pool, 60_000)
    VllmBridge.Worker.OsProcess.kill(w0.os_pid)

    wait_until(
      fn ->
        s = status!()

        Enum.at(s.workers, 0).restarts == Enum.at(before.workers, 0).restarts + 1 and
          Enum.at(s.workers, 0).state == :ready
      end,
      60_000,
      "worker 0 to be back"
    )

    s = status!()
    assert Enum.at(s.workers, 1).restarts == Enum.at(before.workers, 1).restarts
    assert Enum.at(s.workers, 0).os_pid != w0.os_pid
  end

  test "a worker still starting is :starting, then :ready", %{dir: dir} do
    gate = Path.join(dir, "start-gate-#{System.unique_integer([:positive])}")

    task =
      Task.async(fn ->
        VllmBridge.start_pool(:rt_status_starting,
          size: 1,
          allow: [@diag, "rt_gate"],
          worker_env: [python_path([support_dir()])],
          on_start: {"rt_gate", "wait_for", [gate]}
        )
      end)

    on_exit(fn -> VllmBridge.stop_pool(:rt_status_starting) end)

    starting =
      wait_until(
        fn ->
          case Pool.status(:rt_status_starting) do
            {:ok, %{workers: [%{state: :starting, os_pid: p} = w]}} when is_integer(p) -> w
            _ -> nil
          end
        end,
        60_000,
        "the worker to be starting"
      )

    assert starting.running == nil
    File.write!(gate, "")
    assert {:ok, _} = Task.await(task, 60_000)
    assert %{state: :ready, device: device, restarts: 0} = worker!(0, :rt_status_starting)
    assert device?(device)
  end

  # Whether the test interpreter's torch sees a CUDA device (asked once, when this compiles).
  @cuda (case System.cmd(Application.compile_env!(:vllm_bridge, :python), [
                "-c",
                "import torch; print(torch.cuda.is_available())"
              ]) do
           {"True\n", 0} -> true
           _ -> false
         end)

  if not @cuda, do: @tag(skip: "needs a CUDA device")

  test "a GPU worker reports its CUDA memory once CUDA is in use" do
    assert %{device: "cuda:" <> _, cuda_allocated: nil, cuda_reserved: nil} = worker!(0)
    {:ok, session} = Session.open(pool_name: @pool, worker: 0)

    ones =
      VllmBridge.Tensor.new(:binary.copy(<<1.0::float-32-little>>, 1024 * 1024), :float32, [
        1024,
        1024
      ])

    {:ok, _} = VllmBridge.call({@diag, "to_device"}, [ones, "cuda"], %{}, session_id: session.id)
    w = worker!(0)
    # The caching allocator keeps the block the tensor had (4 MiB) reserved.
    assert w.cuda_reserved >= 4 * 1024 * 1024
    assert w.cuda_allocated >= 0 and w.cuda_allocated <= w.cuda_reserved
    Session.close(session)
  end

  test "a pool that is not started, and a bad timeout, are errors naming them" do
    assert {:error, %VllmBridge.Error{type: :bad_argument, message: m}} = Pool.status(:nope)
    assert m =~ ":nope"

    assert {:error, %VllmBridge.Error{type: :bad_argument, message: m}} =
             Pool.status(@pool, timeout: -1)

    assert m =~ "-1"

    # Longer than `receive ... after` takes: refused, not raised in the wait.
    assert {:error, %VllmBridge.Error{type: :bad_argument, message: m}} =
             Pool.status(@pool, timeout: 5_000_000_000)

    assert m =~ "5000000000"
  end
end
