defmodule VllmBridge.Runtime.DirectoryMetaTest do
  @moduledoc """
  A pool's meta and its workers' pids, which every call reads, are kept in
  `:persistent_term` beside the directory's table (VllmBridge.Pool.Directory): both say
  the same while the pool runs, a worker that restarts puts its successor's pid there, a
  queue that restarts republishes the meta (its new pid, the same counters) while its
  workers serve on, and a pool
  that stops leaves nothing behind, so a call to it is refused by name, and a pool
  started again under the name gets a meta of its own.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Error
  alias VllmBridge.Pool.Directory

  @pool :rt_directory_meta
  @key {Directory, {:pool, @pool}}

  defp ping,
    do: VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [1, 2], %{}, pool_name: @pool)

  setup do
    {:ok, _} = VllmBridge.start_pool(@pool, size: 1)
    on_exit(fn -> VllmBridge.stop_pool(@pool) end)
    :ok
  end

  test "a queue that crashes (its terminate/2 runs) leaves its workers serving" do
    {:ok, meta} = Directory.pool(@pool)
    [%{pid: w}] = workers!(@pool)
    # (The queue answers no call: it crashes, and its terminate/2 runs.)
    catch_exit(GenServer.call(meta.queue, :crash_please))
    wait_until(fn -> match?({:ok, %{queue: q}} when q != meta.queue, Directory.pool(@pool)) end)
    assert Directory.worker_pid(@pool, 0) == w
    assert [%{pid: ^w}] = workers!(@pool)
    for _ <- 1..5, do: assert({:ok, 3} = ping())
  end

  test "the meta lives as long as its pool, in both places" do
    assert {:ok, meta} = Directory.pool(@pool)
    assert :persistent_term.get(@key) == meta
    assert [{_, ^meta}] = :ets.lookup(Directory.table(), {:pool, @pool})
    assert {:ok, 3} = ping()

    # Each worker's pid is there too, and a worker that dies is replaced there by its
    # successor (a killed one runs no terminate/2: its successor's start clears it).
    [%{pid: w}] = workers!(@pool)
    assert Directory.worker_pid(@pool, 0) == w
    Process.exit(w, :kill)
    wait_until(fn -> match?([%{pid: p}] when p != w, workers!(@pool)) end)
    [%{pid: w2}] = workers!(@pool)
    assert Directory.worker_pid(@pool, 0) == w2
    assert {:ok, 3} = ping()

    # A queue that dies is restarted by its pool: the meta names the new one.
    Process.exit(meta.queue, :kill)
    wait_until(fn -> match?({:ok, %{queue: q}} when q != meta.queue, Directory.pool(@pool)) end)
    {:ok, again} = Directory.pool(@pool)
    assert Process.alive?(again.queue) and again.slots == meta.slots
    assert [{_, ^again}] = :ets.lookup(Directory.table(), {:pool, @pool})
    assert {:ok, 3} = ping()

    :ok = VllmBridge.stop_pool(@pool)
    assert Directory.pool(@pool) == :error
    assert :persistent_term.get(@key, :none) == :none
    assert Directory.worker_pid(@pool, 0) == nil
    assert :ets.lookup(Directory.table(), {:pool, @pool}) == []
    assert {:error, %Error{type: :bad_argument, message: message}} = ping()
    assert message =~ inspect(@pool)

    # The same name again: a meta of its own (new counters), not the old one.
    {:ok, _} = VllmBridge.start_pool(@pool, size: 1)
    assert {:ok, fresh} = Directory.pool(@pool)
    assert fresh.slots != meta.slots
    assert {:ok, 3} = ping()
  end
end
