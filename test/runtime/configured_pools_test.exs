defmodule VllmBridge.Runtime.ConfiguredPoolsTest do
  @moduledoc """
  Pools from `config :vllm_bridge, pools: [...]`, started with the application: a pool
  that does not start stops the application with a reason that carries the Python
  error and its traceback (what `mix run`, `mix test` or a release prints), and a
  malformed `pools:` value is named. The application is restarted with the test's
  config, and put back as it was after each test.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  @own_dir Path.expand("../support/own_modules", __DIR__)

  setup do
    old = Application.get_env(:vllm_bridge, :pools)
    :ok = Application.stop(:vllm_bridge)

    on_exit(fn ->
      if old,
        do: Application.put_env(:vllm_bridge, :pools, old),
        else: Application.delete_env(:vllm_bridge, :pools)

      {:ok, _} = Application.ensure_all_started(:vllm_bridge)
    end)
  end

  defp start_with(pools) do
    Application.put_env(:vllm_bridge, :pools, pools)
    Application.start(:vllm_bridge)
  end

  test "a configured pool serves once the application has started" do
    assert :ok = start_with(own: [size: 1, python_path: [@own_dir], modules: ["vb_own_mod"]])

    assert {:ok, "own module"} =
             VllmBridge.call({"vb_own_mod", "whoami"}, [], %{}, pool_name: :own)
  end

  test "an on_start that raises stops the application, with the traceback in the reason" do
    pools = [
      own: [
        size: 1,
        python_path: [@own_dir],
        modules: ["vb_own_mod"],
        on_start: {"vb_own_mod", "env", [42]}
      ]
    ]

    assert {:error, {{:pool_start_failed, :own, why}, _}} = start_with(pools)

    assert why =~ "pool :own did not start"
    assert why =~ "on_start vb_own_mod.env failed"
    assert why =~ "Traceback (most recent call last)"
    refute Process.whereis(VllmBridge.Supervisor)
  end

  test "a pools value that is not a keyword list is named" do
    for bad <- [:nope, [:own], [{:own, [size: 1]}, "x"]] do
      assert {:error, {{:bad_pools_config, why}, _}} = start_with(bad)
      assert why =~ "config :vllm_bridge, pools: must be a keyword list"
      refute Process.whereis(VllmBridge.Supervisor)
    end
  end
end
