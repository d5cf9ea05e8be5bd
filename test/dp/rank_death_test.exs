Code.require_file("../support/bindings_helpers.exs", __DIR__)

defmodule VllmBridge.DP.RankDeathTest do
  @moduledoc """
  A DP rank whose Python process is killed (SIGKILL) while the other rank waits in a
  collective: the survivor's call returns the group's error (not the caller's deadline),
  its worker keeps serving with the group marked broken, the killed rank's worker is
  restarted, and the group is joined again the documented way (docs/DEPLOYMENT.md:
  `destroy_dp_group` on the survivors, then `init_dp_group` on every rank).
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias Vllm.Dp.DPGroupInfo
  alias Vllm.Dp.Module, as: DP
  alias VllmBridge.{Error, Tensor, Worker}

  # The group's own bound on a missing peer; the callers' deadline is far beyond it, so an
  # error that comes back is the group's, not the caller giving up.
  @group_timeout_s 20
  @call_timeout 120_000

  setup do
    port = VllmBridge.BindingsHelpers.free_port()

    dp = [
      master_addr: "127.0.0.1",
      master_port: port,
      world_size: 2,
      backend: "gloo",
      timeout_s: @group_timeout_s
    ]

    for rank <- [0, 1], do: start_pool!(pool(rank), dp: Keyword.put(dp, :ranks, [rank]))
    :ok
  end

  defp pool(rank), do: :"dp_death_rank#{rank}"
  defp rt(rank), do: [__runtime__: [pool_name: pool(rank), timeout: @call_timeout]]

  defp on_both(fun),
    do: [0, 1] |> Enum.map(&Task.async(fn -> fun.(&1) end)) |> Task.await_many(@call_timeout)

  defp all_reduce(rank),
    do: DP.dp_all_reduce(Tensor.from_list([rank + 1], :int64), 2, rank, rt(rank))

  test "a rank killed while its peer is in an all_reduce fails the peer's step; the group restarts" do
    assert [{:ok, %DPGroupInfo{}}, {:ok, %DPGroupInfo{}}] = on_both(&DP.init_dp_group(rt(&1)))
    assert [{:ok, t}, {:ok, t}] = on_both(&all_reduce/1)
    assert Tensor.to_list(t) == [3]

    [%{pid: w0, os_pid: survivor}] = workers!(pool(0))
    [%{os_pid: victim}] = workers!(pool(1))

    # Rank 0 enters the step's all_reduce alone: it waits there for rank 1.
    step = Task.async(fn -> all_reduce(0) end)
    wait_until(fn -> running?(w0) end, 30_000, "rank 0 running its all_reduce")
    {_, 0} = System.cmd("kill", ["-KILL", "#{victim}"])

    assert {:error, %Error{type: :python_exception, python_type: type, message: m}} =
             Task.await(step, @call_timeout)

    assert type == "vllm_bridge.dp.DPTimeoutError"
    assert m =~ "DP rank 0 of 2: the all_reduce did not complete within #{@group_timeout_s}"

    # The survivor's worker is the same process and still serves; its group is broken and
    # says how to recover.
    assert [%{os_pid: ^survivor}] = workers!(pool(0))
    assert {:ok, %DPGroupInfo{rank: 0}} = DP.dp_group_info(rt(0))

    assert {:error, %Error{python_type: "vllm_bridge.dp.DPGroupError", message: m}} =
             all_reduce(0)

    assert m =~ "unusable after an earlier failure"
    assert m =~ "call destroy_dp_group() and init_dp_group() again"

    # The killed rank's worker is restarted by its pool: a new process, in no group. (Rank
    # 0's error can come before rank 1's worker has seen its process exit: gloo noticed
    # the closed connection first.)
    wait_until(
      fn -> match?([%{os_pid: pid}] when pid != victim, workers!(pool(1))) end,
      60_000,
      "rank 1's worker restarted"
    )

    refute os_alive?(victim)
    assert {:ok, nil} = DP.dp_group_info(rt(1))

    # Restarting the group: leave it on the survivor, join again on every rank (the same
    # rendezvous: the restarted worker has it in its environment).
    assert {:ok, true} = DP.destroy_dp_group(rt(0))
    assert [{:ok, %DPGroupInfo{}}, {:ok, %DPGroupInfo{}}] = on_both(&DP.init_dp_group(rt(&1)))
    assert [{:ok, t}, {:ok, t}] = on_both(&all_reduce/1)
    assert Tensor.to_list(t) == [3]
    assert [{:ok, true}, {:ok, true}] = on_both(&DP.destroy_dp_group(rt(&1)))
    assert Worker.os_pid(w0) == survivor
  end
end
