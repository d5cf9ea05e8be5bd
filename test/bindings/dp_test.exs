Code.require_file("../support/bindings_helpers.exs", __DIR__)

defmodule VllmBridge.Bindings.DpTest do
  @moduledoc """
  `Vllm.Dp.Module` on two real workers that are the two ranks of a DP group (gloo, CPU):
  joining from the environment and with arguments, the batch coordination across ranks
  (every arity), an all_reduce, and leaving the group.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.BindingsHelpers

  alias Vllm.Config.ParallelConfig
  alias Vllm.Dp.DPGroupInfo
  alias Vllm.Dp.Module, as: DP
  alias VllmBridge.{Error, Session, Tensor}

  setup_all do
    port = free_port()

    env = fn i ->
      [
        {"VLLM_DP_RANK", "#{i}"},
        {"VLLM_DP_SIZE", "2"},
        {"VLLM_DP_MASTER_PORT", "#{port}"},
        {"VLLM_DP_BACKEND", "gloo"},
        {"VLLM_DP_TIMEOUT_S", "60"}
      ]
    end

    start_default_pool!(size: 2, worker_env: env)
    ranks = for i <- 0..1, do: elem(Session.open(pool_name: :bindings, worker: i), 1)
    on_exit(fn -> Enum.each(ranks, &Session.close/1) end)
    %{port: port, ranks: ranks}
  end

  # Runs `fun.(rank, runtime_options)` on both ranks at once (collectives need both).
  defp on_both(ranks, fun) do
    ranks
    |> Enum.with_index()
    |> Enum.map(fn {s, i} ->
      Task.async(fn -> fun.(i, __runtime__: [session_id: s, timeout: 90_000]) end)
    end)
    |> Task.await_many(120_000)
  end

  test "the bindings and their arities" do
    assert exported(DP) == %{
             coordinate_batch_across_dp: 4..9,
             default_timeout_s: 0..1,
             destroy_dp_group: 0..1,
             dp_all_gather: 3..4,
             dp_all_reduce: 3..4,
             dp_group_info: 0..1,
             init_dp_group: 0..7
           }
  end

  test "a DP group of two workers: join, coordinate, all_reduce, leave", %{
    ranks: ranks,
    port: port
  } do
    assert DP.default_timeout_s() == {:ok, 60.0}
    assert DP.default_timeout_s(__runtime__: [timeout: 10_000]) == {:ok, 60.0}
    assert DP.dp_group_info() == {:ok, nil}
    assert [{:ok, nil}, {:ok, nil}] = on_both(ranks, fn _, rt -> DP.dp_group_info(rt) end)

    # init_dp_group/1 (only the options): everything from the environment.
    infos = on_both(ranks, fn _, rt -> DP.init_dp_group(rt) end)

    for {{:ok, info}, i} <- Enum.with_index(infos) do
      assert info == %DPGroupInfo{
               rank: i,
               world_size: 2,
               master_addr: "127.0.0.1",
               master_port: port,
               backend: "gloo",
               timeout_s: 60.0
             }
    end

    # Without options (any worker, the environment's settings): the current group.
    assert {:ok, %DPGroupInfo{world_size: 2}} = DP.init_dp_group()
    assert {:ok, %DPGroupInfo{world_size: 2}} = DP.dp_group_info()

    # The other arities, with the same settings, answer the current group.
    for {s, i} <- Enum.with_index(ranks) do
      rt = [__runtime__: [session_id: s]]
      same = [i, 2, "127.0.0.1", port, "gloo", 60.0]

      for k <- 1..6,
          do:
            assert(
              {:ok, %DPGroupInfo{rank: ^i}} =
                apply(DP, :init_dp_group, Enum.take(same, k) ++ [rt])
            )

      for k <- 0..6,
          do:
            assert({:ok, %DPGroupInfo{}} = apply(DP, :init_dp_group, Enum.take(same, k) ++ [rt]))

      assert {:ok, %DPGroupInfo{rank: ^i}} = DP.dp_group_info(rt)

      assert {:error, %Error{type: :python_exception, python_type: "vllm_bridge.dp.DPGroupError"}} =
               DP.init_dp_group(i, 2, "127.0.0.1", port, "gloo", 5.0, rt)
    end

    # coordinate_batch_across_dp on both ranks at once: optional parameters positionally
    # (arities 5..9, the options last: each rank's call carries its session) or by name.
    positional = fn i -> [[], [8], [8, nil], [8, nil, nil], [8, nil, nil, 2 - i]] end

    for n <- 0..5 do
      results =
        on_both(ranks, fn i, rt ->
          pc = %ParallelConfig{data_parallel_size: 2, data_parallel_rank: i}

          extra =
            if n < 5,
              do: Enum.at(positional.(i), n) ++ [rt],
              else: [[num_tokens_padded: 8, cudagraph_mode: 2 - i] ++ rt]

          apply(DP, :coordinate_batch_across_dp, [3 + 2 * i, false, true, pc | extra])
        end)

      # Both ranks get the same answer: padded to the largest count, the smallest mode.
      assert [{:ok, {false, counts, mode}}, {:ok, {false, counts, mode}}] = results
      assert Tensor.to_list(counts) == if(n == 0, do: [5, 5], else: [8, 8])
      assert mode == if(n >= 4, do: 1, else: 0)
    end

    # Without options (arities 4..8) a call has no session: with DP off it needs none.
    off = %ParallelConfig{}

    for extra <- [[], [8], [8, nil], [8, nil, nil], [8, nil, nil, 1]] do
      assert {:ok, {false, nil, mode}} =
               apply(DP, :coordinate_batch_across_dp, [3, false, true, off | extra])

      assert mode == if(length(extra) == 4, do: 1, else: 0)
    end

    sums =
      on_both(ranks, fn i, rt ->
        DP.dp_all_reduce(Tensor.from_list([i + 1, 10], :int64), 2, i, rt)
      end)

    assert Enum.map(sums, fn {:ok, t} -> Tensor.to_list(t) end) == [[3, 20], [3, 20]]

    # Every rank's tensor, stacked by rank, on both ranks.
    gathered =
      on_both(ranks, fn i, rt ->
        DP.dp_all_gather(Tensor.from_list([i + 1, 10 * i], :int64), 2, i, rt)
      end)

    assert Enum.map(gathered, fn {:ok, t} -> {t.shape, Tensor.to_list(t)} end) ==
             [{[2, 2], [[1, 0], [2, 10]]}, {[2, 2], [[1, 0], [2, 10]]}]

    assert {:error, %Error{type: :python_exception, message: m}} =
             DP.dp_all_reduce(Tensor.from_list([1], :int64), 4, 0,
               __runtime__: [session_id: hd(ranks)]
             )

    assert m =~ "parallel_config says DP rank 0 of 4 but this process joined as rank 0 of 2"

    assert [{:ok, true}, {:ok, true}] = on_both(ranks, fn _, rt -> DP.destroy_dp_group(rt) end)
    assert [{:ok, nil}, {:ok, nil}] = on_both(ranks, fn _, rt -> DP.dp_group_info(rt) end)
    assert {:ok, false} = DP.destroy_dp_group(__runtime__: [session_id: hd(ranks)])
    assert {:ok, false} = DP.destroy_dp_group()
  end

  test "a call cannot point a worker's rendezvous at a host of its choosing", %{
    ranks: [rank0 | _],
    port: port
  } do
    rt = [__runtime__: [session_id: rank0]]

    # Refused by the worker before it resolves or connects: only the pool's dp: option
    # (the worker's VLLM_DP_MASTER_IP) names a remote rendezvous.
    for addr <- ["10.1.2.3", "127.1", "0x7f000001", "metadata.google.internal", ""] do
      assert {:error, %Error{type: :python_exception, python_type: "ValueError", message: m}} =
               DP.init_dp_group(0, 1, addr, port, "gloo", 1.0, rt)

      assert m =~ "master_addr '#{addr}' is refused"
      assert m =~ "pool's dp: option (VLLM_DP_MASTER_IP"
    end

    assert {:error, %Error{python_type: "ValueError", message: m}} =
             DP.init_dp_group(0, 1, "10.1.2.3", port, "gloo", 1.0)

    assert m =~ "master_addr '10.1.2.3' is refused"

    # The worker serves on, in no group, and its session with it.
    assert DP.dp_group_info(rt) == {:ok, nil}
    assert DP.default_timeout_s(rt) == {:ok, 60.0}
  end

  test "bad arguments" do
    assert {:error, %Error{type: :bad_argument, message: m}} = DP.init_dp_group("0")
    assert m =~ ~s|rank must be integer() \| nil, got "0"|
    assert {:error, %Error{type: :bad_argument, message: m}} = DP.dp_all_reduce([1, 2], 1, 0)
    assert m =~ "tensor must be VllmBridge.Tensor.t()"
    assert {:error, %Error{type: :bad_argument, message: m}} = DP.dp_all_gather("t", 1, 0)
    assert m =~ ~s|tensor must be VllmBridge.Tensor.t(), got "t"|

    assert {:error, %Error{type: :python_exception, python_type: "ValueError", message: m}} =
             DP.init_dp_group(0, 1, "127.0.0.1", 1, "mpi")

    assert m =~ "backend must be one of"
  end
end
