defmodule VllmBridge.DemoNodesTest do
  @moduledoc """
  `mix vllm.demo --nodes 2`'s run: DP rank 1's worker on a second BEAM node started on
  this machine (`:peer` over 127.0.0.1), rank 0's here; the DP run must equal rank 0
  running every rank's tokens alone, as on one node, and both nodes' pools are gone after.
  """
  use ExUnit.Case, async: false

  alias VllmBridge.Demo

  @moduletag timeout: 300_000

  setup_all do
    dir = Path.join(System.tmp_dir!(), "vllm_demo_nodes_#{System.unique_integer([:positive])}")
    on_exit(fn -> File.rm_rf(dir) end)
    {:ok, lines} = Agent.start_link(fn -> [] end)
    out = fn line -> Agent.update(lines, &[line | &1]) end
    was_alive = Node.alive?()

    result = Demo.run(steps: 4, seed: 7, nodes: 2, pool: :demo_nodes, weights_dir: dir, out: out)

    printed = lines |> Agent.get(&Enum.reverse/1) |> Enum.join("\n")
    Agent.stop(lines)
    %{result: result, printed: printed, was_alive: was_alive}
  end

  test "the DP run across two nodes equals rank 0 alone", %{result: result} do
    assert Demo.Check.passed?(result.check)
    %{compared: compared, mismatches: []} = result.check

    sampled =
      for {_, outs} <- result.steps, out <- outs, reduce: 0, do: (n -> n + length(out["req_ids"]))

    assert compared == sampled and compared > 5
    # Both ranks loaded the same weights, each its own half of the experts.
    assert Enum.map(result.runners, & &1["local_experts"]) == [[0, 3], [4, 7]]

    for {{_, [r0, r1]}, index} <- Enum.with_index(result.steps, 1) do
      assert r0["num_tokens_across_dp"] == r1["num_tokens_across_dp"], "step #{index}"
    end
  end

  test "the output names each rank's node: rank 0 here, rank 1 on the peer", %{printed: printed} do
    assert [_, here] = Regex.run(~r/rank 0 runs on node (\S+) \(this node\)/, printed)
    assert [_, peer] = Regex.run(~r/rank 1 runs on node (\S+) \(the peer node\)/, printed)
    assert here != peer and String.ends_with?(peer, "@127.0.0.1")
    assert printed =~ ~r/rank 1 ready: os pid \d+/
    assert printed =~ "DP group: 2 ranks over gloo at 127.0.0.1:"
    assert printed =~ "tokens identical: "
  end

  test "afterwards: the pool and the peer node are gone, distribution as before", %{
    was_alive: was_alive,
    printed: printed
  } do
    assert {:error, %VllmBridge.Error{}} = VllmBridge.Pool.workers(:demo_nodes)
    [_, peer] = Regex.run(~r/rank 1 runs on node (\S+) /, printed)
    refute String.to_atom(peer) in Node.list()
    # Rank 1's Python process went with the peer node (it sees EOF and exits).
    [_, os_pid] = Regex.run(~r/rank 1 ready: os pid (\d+)/, printed)
    import VllmBridge.RuntimeHelpers, only: [wait_until: 3, os_alive?: 1]
    wait_until(fn -> not os_alive?(String.to_integer(os_pid)) end, 30_000, "rank 1 exited")
    assert Node.alive?() == was_alive
  end
end
