defmodule VllmBridge.Runtime.CallAllTest do
  @moduledoc """
  `VllmBridge.call_all/5`: one call on every worker, results in worker order; one failing
  worker makes an error that names it and keeps every result; options that conflict
  with it are refused; a worker that goes down during it is an entry, not a hang.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Error
  alias VllmBridge.Worker.OsProcess

  @own_dir Path.expand("../support/own_modules", __DIR__)
  @pool :ca_three

  @doc false
  def rank_env(index), do: [{"VB_RANK", Integer.to_string(index)}]

  setup_all do
    start_pool!(@pool,
      size: 3,
      python_path: [@own_dir],
      modules: ["vb_setup_mod"],
      worker_env: {__MODULE__, :rank_env, []}
    )

    :ok
  end

  setup do
    await_idle!(@pool)
    :ok
  end

  test "one result per worker, in worker index order" do
    assert {:ok, ["0", "1", "2"]} = VllmBridge.call_all(@pool, {"vb_setup_mod", "rank"})

    assert {:ok, infos} = VllmBridge.call_all(@pool, {"vllm_bridge.bridge.diag", "info"})
    assert Enum.map(infos, & &1["pid"]) == Enum.map(workers!(@pool), & &1.os_pid)
  end

  test "the calls run at the same time on the workers" do
    # Each sleeps 0.5 s; all three are running on their workers at one moment.
    task =
      Task.async(fn ->
        VllmBridge.call_all(@pool, {"vllm_bridge.bridge.diag", "sleep"}, [0.5])
      end)

    ws = workers!(@pool)
    wait_until(fn -> Enum.all?(ws, &running?(&1.pid)) end, 5_000, "all three running")
    assert {:ok, [_, _, _]} = Task.await(task, 30_000)
  end

  test "one worker fails: the error names it, and every result is kept in order" do
    assert {:error, %Error{type: :python_exception, python_type: "ValueError"} = e} =
             VllmBridge.call_all(@pool, {"vb_setup_mod", "fail_on_rank"}, ["1"])

    assert e.message =~ "1 of 3 worker(s) failed (1)"
    assert e.message =~ "worker 1:"
    assert e.message =~ "rank 1 refuses"

    assert [{:ok, "0"}, {:error, %Error{python_type: "ValueError"}}, {:ok, "2"}] =
             e.details.results
  end

  test "arguments, kwargs and runtime options reach every call" do
    assert {:ok, [5, 5, 5]} =
             VllmBridge.call_all(@pool, {"vllm_bridge.bridge.diag", "add"}, [2], %{"b" => 3},
               timeout: 10_000,
               pool_name: @pool
             )

    assert {:error, %Error{type: :timeout} = e} =
             VllmBridge.call_all(@pool, {"vllm_bridge.bridge.diag", "sleep"}, [5], %{},
               timeout: 100
             )

    assert e.message =~ "3 of 3 worker(s) failed"
    assert Enum.all?(e.details.results, &match?({:error, %Error{type: :timeout}}, &1))
  end

  test "a pool_name other than the pool, and a session_id, are refused" do
    assert {:error, %Error{type: :bad_argument, message: m}} =
             VllmBridge.call_all(@pool, {"vb_setup_mod", "rank"}, [], %{}, pool_name: :other)

    assert m =~ ":other" and m =~ inspect(@pool)

    assert {:error, %Error{type: :bad_argument, message: m}} =
             VllmBridge.call_all(@pool, {"vb_setup_mod", "rank"}, [], %{}, session_id: "s-1")

    assert m =~ "session"

    assert {:error, %Error{type: :bad_argument, message: m}} =
             VllmBridge.call_all(:ca_nope, {"vb_setup_mod", "rank"})

    assert m =~ ":ca_nope"
  end

  test "inside a session, call_all still runs on every worker (outside the session)" do
    assert {:ok, ["0", "1", "2"]} =
             VllmBridge.with_session(
               fn _s -> VllmBridge.call_all(@pool, {"vb_setup_mod", "rank"}) end,
               pool_name: @pool
             )
  end

  test "a reference target is refused: it lives on one worker" do
    {:ok, ref} = VllmBridge.call({"vllm_bridge.bridge.diag", "opaque"}, [], %{}, pool_name: @pool)
    assert {:error, %Error{type: :bad_argument}} = VllmBridge.call_all(@pool, {ref, "x"})
  end

  test "a worker that dies during the call is an error entry, the others answer" do
    ws = workers!(@pool)

    task =
      Task.async(fn ->
        VllmBridge.call_all(@pool, {"vllm_bridge.bridge.diag", "sleep"}, [1.0])
      end)

    wait_until(fn -> Enum.all?(ws, &running?(&1.pid)) end, 5_000, "all three running")
    OsProcess.kill(Enum.at(ws, 1).os_pid)

    assert {:error, %Error{type: :worker_exit} = e} = Task.await(task, 30_000)
    assert [{:ok, _}, {:error, %Error{type: :worker_exit}}, {:ok, _}] = e.details.results
    assert e.message =~ "worker 1:"

    # While it restarts, its entry is an error at once, not a wait.
    case VllmBridge.call_all(@pool, {"vb_setup_mod", "rank"}) do
      {:ok, ["0", "1", "2"]} -> :ok
      {:error, e} -> assert [{:ok, "0"}, {:error, _}, {:ok, "2"}] = e.details.results
    end
  end
end
