Code.require_file("../support/bindings_helpers.exs", __DIR__)

defmodule VllmBridge.DP.RendezvousTest do
  @moduledoc """
  `VllmBridge.DP.Rendezvous` and the pool option `dp:`: bad rendezvous values refused in
  Elixir naming the value, and two pools of one rank each (as on two hosts) joining one
  gloo group through `dp:` alone, and through `Rendezvous.kwargs/2` per call.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  alias Vllm.Dp.DPGroupInfo
  alias Vllm.Dp.Module, as: DP
  alias VllmBridge.{Error, Tensor}
  alias VllmBridge.DP.Rendezvous

  @good [master_addr: "127.0.0.1", master_port: 29_500, world_size: 2, ranks: [1]]

  describe "new/1" do
    test "a good rendezvous, from a keyword list, a map, a struct; ranges and IP tuples" do
      assert {:ok, %Rendezvous{ranks: [1], backend: nil, timeout_s: nil} = r} =
               Rendezvous.new(@good)

      assert Rendezvous.new(Map.new(@good)) == {:ok, r}
      assert Rendezvous.new(r) == {:ok, r}

      assert {:ok, %Rendezvous{master_addr: "10.0.0.7", ranks: [0, 1, 2]}} =
               Rendezvous.new(
                 Keyword.merge(@good, master_addr: {10, 0, 0, 7}, world_size: 4, ranks: 0..2)
               )

      assert Rendezvous.env(r, 0) == [
               {"VLLM_DP_RANK", "1"},
               {"VLLM_DP_SIZE", "2"},
               {"VLLM_DP_MASTER_IP", "127.0.0.1"},
               {"VLLM_DP_MASTER_PORT", "29500"}
             ]

      {:ok, r} = Rendezvous.new(Keyword.merge(@good, backend: "gloo", timeout_s: 5))
      assert {"VLLM_DP_BACKEND", "gloo"} in Rendezvous.env(r, 0)
      assert {"VLLM_DP_TIMEOUT_S", "5"} in Rendezvous.env(r, 0)
      assert Rendezvous.kwargs(r, 0)[:timeout_s] == 5.0
    end

    test "every bad value is refused naming the field and the value" do
      cases = [
        {[master_port: 0], "master_port must be an integer from 1 to 65535, got 0"},
        {[master_port: 65_536], "got 65536"},
        {[master_port: "29500"], ~s(master_port must be an integer from 1 to 65535, got "29500")},
        {[world_size: 0], "world_size must be a positive integer, got 0"},
        {[ranks: [2]], "rank 2 is not below world_size 2"},
        {[ranks: [0, 0]], "name rank 0 twice"},
        {[ranks: [-1]], "ranks must be a list of non-negative integers, got [-1]"},
        {[ranks: []], "ranks must be a non-empty list or range of DP ranks, got []"},
        {[ranks: 1], "got 1"},
        {[master_addr: "0.0.0.0"],
         ~s(master_addr must be the address the other ranks connect to)},
        {[master_addr: ""], ~s(master_addr must be an IP address or a host name, got "")},
        {[master_addr: "a b"], ~s(got "a b")},
        {[master_addr: :host], "got :host"},
        {[master_addr: {1, 2, 3}], "got {1, 2, 3}"},
        {[backend: "mpi"],
         ~s(backend must be nil or one of ["gloo", "nccl", "cpu:gloo,cuda:nccl"], got "mpi")},
        {[timeout_s: 0], "timeout_s must be nil or a positive number of seconds, got 0"},
        {[timeout_s: :infinity], "got :infinity"},
        {[port: 1], "unknown field(s) [:port]"}
      ]

      for {change, message} <- cases do
        assert {:error, %Error{type: :bad_argument, message: m}} =
                 Rendezvous.new(Keyword.merge(@good, change)),
               "#{inspect(change)} was accepted"

        assert m =~ message, "#{inspect(change)}: #{m}"
      end

      for missing <- [:master_addr, :master_port, :world_size, :ranks] do
        assert {:error, %Error{message: m}} = Rendezvous.new(Keyword.delete(@good, missing))
        assert m =~ "#{missing} must be", m
      end

      assert {:error, %Error{message: m}} = Rendezvous.new("x")
      assert m =~ ~s(got "x")
      assert {:error, %Error{message: m}} = Rendezvous.new([1])
      assert m =~ "must be a keyword list, got [1]"
    end
  end

  describe "the pool option dp:" do
    test "one rank per worker, and worker_env may not set what dp: gives" do
      assert {:error, %Error{type: :bad_argument, message: m}} =
               VllmBridge.start_pool(:dp_bad, size: 2, dp: @good)

      assert m =~ "pool option dp: ranks [1] must name one DP rank per worker (size: 2)"

      assert {:error, %Error{type: :bad_argument, message: m}} =
               VllmBridge.start_pool(:dp_bad,
                 dp: @good,
                 worker_env: [{"VLLM_DP_MASTER_PORT", "1"}]
               )

      assert m =~ "worker 0's environment sets VLLM_DP_MASTER_PORT, which dp: gives"

      assert {:error, %Error{message: m}} =
               VllmBridge.start_pool(:dp_bad, dp: Keyword.put(@good, :master_port, 70_000))

      assert m =~ "pool option dp: master_port must be an integer from 1 to 65535, got 70000"
      refute :dp_bad in VllmBridge.Pool.names()
    end

    test "two pools of one rank each join one gloo group: from dp: alone, then per call" do
      port = VllmBridge.BindingsHelpers.free_port()
      dp = [master_addr: "127.0.0.1", master_port: port, world_size: 2, backend: "gloo"]

      for {pool, rank} <- [dp_rank0: 0, dp_rank1: 1] do
        {:ok, _} = VllmBridge.start_pool(pool, dp: Keyword.put(dp, :ranks, [rank]))
        on_exit(fn -> VllmBridge.stop_pool(pool) end)
      end

      rt = fn rank -> [__runtime__: [pool_name: :"dp_rank#{rank}", timeout: 90_000]] end

      on_both = fn fun ->
        [0, 1] |> Enum.map(&Task.async(fn -> fun.(&1) end)) |> Task.await_many(120_000)
      end

      infos = on_both.(&DP.init_dp_group(rt.(&1)))

      assert [{:ok, %DPGroupInfo{rank: 0} = i0}, {:ok, %DPGroupInfo{rank: 1} = i1}] = infos
      for i <- [i0, i1], do: assert({i.world_size, i.master_port, i.backend} == {2, port, "gloo"})

      sums = on_both.(&DP.dp_all_reduce(Tensor.from_list([&1 + 1, 10], :int64), 2, &1, rt.(&1)))
      assert Enum.map(sums, fn {:ok, t} -> Tensor.to_list(t) end) == [[3, 20], [3, 20]]
      assert [{:ok, true}, {:ok, true}] = on_both.(&DP.destroy_dp_group(rt.(&1)))

      # The same group joined per call, from a rendezvous struct (any worker could).
      {:ok, r} = Rendezvous.new(Keyword.put(dp, :ranks, [0, 1]))
      infos = on_both.(&DP.init_dp_group(Rendezvous.kwargs(r, &1) ++ rt.(&1)))
      assert [{:ok, %DPGroupInfo{rank: 0}}, {:ok, %DPGroupInfo{rank: 1}}] = infos
      assert [{:ok, true}, {:ok, true}] = on_both.(&DP.destroy_dp_group(rt.(&1)))
    end
  end
end
