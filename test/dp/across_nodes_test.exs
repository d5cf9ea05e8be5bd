defmodule VllmBridge.DP.AcrossNodesTest do
  @moduledoc """
  DP across two BEAM nodes: a `:peer` node over 127.0.0.1 (`VllmBridge.Demo.Nodes`),
  rank 0's pool here and rank 1's there, one gloo group joined through the pool option
  `dp:`; the step's agreement and an all_reduce across the nodes give what the same
  calls give with both ranks' pools on this node.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log
  @moduletag timeout: 240_000

  alias Vllm.Config.ParallelConfig
  alias Vllm.Dp.DPGroupInfo
  alias Vllm.Dp.Module, as: DP
  alias VllmBridge.Demo.Nodes
  alias VllmBridge.Tensor

  setup_all do
    {:ok, peer} = Nodes.start_peer(:"dp_across_#{System.unique_integer([:positive])}")
    on_exit(fn -> Nodes.stop_peer(peer) end)
    %{peer: peer.node}
  end

  # Both ranks' pools (rank 0 here, rank 1 on `node1`), the group joined; runs the step
  # on both ranks at once. Every call is `:erpc` of a binding (a module compiled on both
  # nodes: this test's own functions exist only here).
  defp run_group(node1, pool) do
    port = VllmBridge.Demo.Ranks.free_port()
    dp = [master_addr: "127.0.0.1", master_port: port, world_size: 2, backend: "gloo"]
    nodes = [node(), node1]
    # A pool per rank, named apart: on one node the two must differ.
    pools = [:"#{pool}_rank0", :"#{pool}_rank1"]

    for {{node, pool}, rank} <- Enum.with_index(Enum.zip(nodes, pools)) do
      opts = [dp: Keyword.put(dp, :ranks, [rank]), worker_env: [{"OMP_NUM_THREADS", 1}]]
      assert {:ok, _} = :erpc.call(node, VllmBridge.Pool, :start, [pool, opts])
    end

    # `args.(rank)` ++ the options, for DP.fun on both ranks at once.
    on_both = fn fun, args ->
      Enum.zip(nodes, pools)
      |> Enum.with_index()
      |> Enum.map(fn {{node, pool}, rank} ->
        rt = [__runtime__: [pool_name: pool, timeout: 90_000]]
        Task.async(fn -> :erpc.call(node, DP, fun, args.(rank) ++ [rt], 120_000) end)
      end)
      |> Task.await_many(120_000)
    end

    try do
      joined = on_both.(:init_dp_group, fn _ -> [] end)

      pc = &%ParallelConfig{data_parallel_size: 2, data_parallel_rank: &1}
      agreed = on_both.(:coordinate_batch_across_dp, &[5 + 20 * &1, false, true, pc.(&1)])
      x = &Tensor.from_list(for(i <- 1..8, do: :math.sin(i * (&1 + 1)) / 3), :float32)
      sums = on_both.(:dp_all_reduce, &[x.(&1), 2, &1])
      gathered = on_both.(:dp_all_gather, &[Tensor.from_list([&1, 10 * &1], :int64), 2, &1])

      workers =
        for {node, pool} <- Enum.zip(nodes, pools),
            do: :erpc.call(node, VllmBridge.Pool, :workers, [pool])

      assert [{:ok, true}, {:ok, true}] = on_both.(:destroy_dp_group, fn _ -> [] end)
      %{joined: joined, agreed: agreed, sums: sums, gathered: gathered, workers: workers}
    after
      for {node, pool} <- Enum.zip(nodes, pools),
          do: :erpc.call(node, VllmBridge, :stop_pool, [pool])
    end
  end

  test "two ranks on two nodes join one gloo group and step as on one node", %{peer: peer} do
    across = run_group(peer, :dp_across)
    assert [{:ok, %DPGroupInfo{rank: 0}}, {:ok, %DPGroupInfo{rank: 1}}] = across.joined
    # One worker per node: rank 1's pool is on the peer only, so its calls ran there.
    assert [{:ok, [%{os_pid: os0}]}, {:ok, [%{os_pid: os1}]}] = across.workers
    assert os0 != os1

    assert [{:ok, {false, counts, 0}}, {:ok, {false, counts, 0}}] = across.agreed
    assert Tensor.to_list(counts) == [25, 25]
    assert [{:ok, sum}, {:ok, sum}] = across.sums
    assert [{:ok, gathered}, {:ok, gathered}] = across.gathered
    assert Tensor.to_list(gathered) == [[0, 0], [1, 10]]

    one_node = run_group(node(), :dp_one_node)
    assert [{:ok, %DPGroupInfo{rank: 0}}, {:ok, %DPGroupInfo{rank: 1}}] = one_node.joined
    assert one_node.agreed == across.agreed
    assert one_node.gathered == across.gathered
    # Bit for bit: the same gloo sum of the same float32 tensors.
    assert [{:ok, sum1}, {:ok, sum1}] = one_node.sums
    assert sum1 == sum
  end
end
