defmodule VllmBridge.Runtime.PoolTest do
  @moduledoc """
  Pools serving calls: routing by `pool_name:` (and the configured default), a DP rank per
  worker from `worker_env`, errors that leave the pool serving, and 10 000 concurrent calls
  from 100 processes each matched to its caller.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Pool, Session}

  @allow ["vllm_bridge.bridge.diag", "os"]

  setup_all do
    start_pool!(:rt_a,
      size: 2,
      allow: @allow,
      worker_env: fn i -> [{"VB_POOL", "a"}, {"VLLM_DP_RANK", "#{i}"}] end
    )

    start_pool!(:rt_b, size: 1, allow: @allow, worker_env: [{"VB_POOL", "b"}])
    :ok
  end

  defp getenv(name, opts), do: VllmBridge.call({"os", "getenv"}, [name], %{}, opts)

  test "pool_name routes a call to that pool's workers" do
    assert {:ok, "a"} = getenv("VB_POOL", pool_name: :rt_a)
    assert {:ok, "b"} = getenv("VB_POOL", pool_name: :rt_b)

    [%{os_pid: b_pid}] = workers!(:rt_b)
    a_pids = for w <- workers!(:rt_a), do: w.os_pid

    assert {:ok, %{"pid" => ^b_pid}} =
             VllmBridge.call({"vllm_bridge.bridge.diag", "info"}, [], %{}, pool_name: :rt_b)

    assert {:ok, %{"pid" => pid}} =
             VllmBridge.call({"vllm_bridge.bridge.diag", "info"}, [], %{}, pool_name: :rt_a)

    assert pid in a_pids
  end

  test "the default pool name comes from the application config" do
    old = Application.get_env(:vllm_bridge, :runtime)
    Application.put_env(:vllm_bridge, :runtime, pool_name: :rt_b)

    try do
      assert {:ok, "b"} = getenv("VB_POOL", [])
      assert {:ok, "a"} = getenv("VB_POOL", pool_name: :rt_a)
    after
      if old,
        do: Application.put_env(:vllm_bridge, :runtime, old),
        else: Application.delete_env(:vllm_bridge, :runtime)
    end
  end

  test "each worker gets its own environment (a DP rank per worker)" do
    for i <- 0..1 do
      VllmBridge.with_session(
        fn s -> assert getenv("VLLM_DP_RANK", session_id: s.id) == {:ok, "#{i}"} end,
        pool_name: :rt_a,
        worker: i
      )
    end

    assert {:ok, nil} = getenv("VLLM_DP_RANK", pool_name: :rt_b)
  end

  test "a pool that is not started is a clear error" do
    assert {:error, %Error{type: :bad_argument, message: msg}} =
             VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [1, 2], %{}, pool_name: :nope)

    assert msg =~ "pool :nope is not started"
    assert {:error, %Error{type: :bad_argument}} = Session.open(pool_name: :nope)
    assert {:error, %Error{type: :bad_argument}} = VllmBridge.stop_pool(:nope)
  end

  test "a pool name cannot be started twice" do
    assert {:error, %Error{type: :bad_argument, message: msg}} =
             VllmBridge.start_pool(:rt_b, size: 1)

    assert msg =~ "already started"
  end

  test "bad pool options are refused by name before anything starts" do
    assert {:error, %Error{type: :bad_argument, message: m1}} =
             VllmBridge.start_pool(:bad, sise: 2)

    assert m1 =~ ":sise"

    assert {:error, %Error{type: :bad_argument, message: m2}} =
             VllmBridge.start_pool(:bad, size: 0)

    assert m2 =~ "size"

    assert {:error, %Error{type: :bad_argument, message: m3}} =
             VllmBridge.start_pool(:bad, worker_env: "X=1")

    assert m3 =~ "worker_env"

    for bad <- [-1, 10_001, 1.5, "100"] do
      assert {:error, %Error{type: :bad_argument, message: m4}} =
               VllmBridge.start_pool(:bad, poll_us: bad)

      assert m4 =~ "poll_us" and m4 =~ "from 0 to 10000"
    end

    refute :bad in Pool.names()
  end

  test "a pool whose allow-list names a module that cannot be imported does not start" do
    assert {:error, %Error{type: :bad_argument, message: m}} =
             VllmBridge.start_pool(:rt_broken,
               allow: ["vllm_bridge.bridge.diag", "no_such_pkg.mod"]
             )

    assert m =~ "pool :rt_broken did not start"
    assert m =~ "could not import allow-listed module(s): no_such_pkg.mod (ModuleNotFoundError"
    refute :rt_broken in Pool.names()
  end

  test "poll_us reaches each worker's command line, and a polling pool serves" do
    start_pool!(:rt_poll, size: 1, poll_us: 500)
    [%{os_pid: os_pid}] = workers!(:rt_poll)
    args = "/proc/#{os_pid}/cmdline" |> File.read!() |> String.split(<<0>>, trim: true)
    assert Enum.take(args, -4) == ["--poll-us", "500", "--max-frame-bytes", "1073741824"]

    for i <- 1..20,
        do:
          assert(
            {:ok, ^i} =
              VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [i, 0], %{}, pool_name: :rt_poll)
          )

    [%{os_pid: plain}] = workers!(:rt_b)
    refute "--poll-us" in ("/proc/#{plain}/cmdline" |> File.read!() |> String.split(<<0>>))
  end

  test "Python exceptions and refused targets come back as errors; the pool keeps serving" do
    assert {:error, %Error{type: :python_exception, python_type: "ValueError"} = e} =
             VllmBridge.call({"vllm_bridge.bridge.diag", "fail"}, ["boom"], %{}, pool_name: :rt_b)

    assert e.message == "boom"
    assert e.traceback =~ "Traceback"
    assert is_integer(e.details.exc_id)

    assert {:error, %Error{type: :bad_argument, message: msg}} =
             VllmBridge.call({"subprocess", "run"}, [["true"]], %{}, pool_name: :rt_b)

    assert msg =~ "subprocess"

    assert {:ok, 5} =
             VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [2, 3], %{}, pool_name: :rt_b)
  end

  test "kwargs travel as a map or a keyword list; get reads an attribute" do
    assert {:ok, 7} =
             VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [], [a: 3, b: 4],
               pool_name: :rt_b
             )

    assert {:ok, 7} =
             VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [3], %{"b" => 4},
               pool_name: :rt_b
             )

    assert {:ok, "HIGH"} =
             VllmBridge.get({"vllm_bridge.bridge.diag", "Level.HIGH.name"}, pool_name: :rt_b)
  end

  test "a value that cannot be encoded is refused in the caller, naming it" do
    assert {:error, %Error{type: :bad_argument, message: msg}} =
             VllmBridge.call({"vllm_bridge.bridge.diag", "echo"}, [self()], %{}, pool_name: :rt_b)

    assert msg =~ inspect(self())

    assert {:ok, 2} =
             VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [1, 1], %{}, pool_name: :rt_b)
  end

  test "10 000 concurrent calls from 100 processes: every reply reaches its caller" do
    parent = self()

    tasks =
      for p <- 1..100 do
        Task.async(fn ->
          for i <- 1..100 do
            value = %{"p" => p, "i" => i, "tag" => "#{p}/#{i}"}

            {:ok, back} =
              VllmBridge.call({"vllm_bridge.bridge.diag", "echo"}, [value], %{}, pool_name: :rt_a)

            back == value || send(parent, {:mismatch, value, back})
          end
          |> Enum.count(& &1)
        end)
      end

    assert Enum.sum(Enum.map(tasks, &Task.await(&1, 120_000))) == 10_000
    refute_received {:mismatch, _, _}
    {:ok, meta} = Pool.meta(:rt_a)
    assert VllmBridge.Pool.Slots.waiting(meta) == 0
    assert Enum.map(workers!(:rt_a), & &1.load) == [0, 0]
  end
end
