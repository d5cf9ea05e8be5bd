defmodule VllmBridge.Runtime.RuntimeFastPathTest do
  @moduledoc """
  `VllmBridge.Call.Runtime.resolve/2`'s one-pass path (no `:runtime` config, plain values)
  answers exactly as its general path, over generated option lists: valid and invalid
  values of every option, unknown keys, keys given twice, lists that are not keyword
  lists, both kinds, inside and outside a current session. The general path is forced by
  a `:runtime` config that changes nothing (`affinity: :strict_queue`, the default).
  bench/results/fast-paths.md ("Fast paths beside general paths") has what the one-pass
  path saves.
  """
  use ExUnit.Case, async: false

  alias VllmBridge.Call.Runtime
  alias VllmBridge.Session

  @session %Session{id: "s-1", pool: :p, worker: 0, instance: "i", owner: nil}

  @values %{
    timeout: [0, 5, 120_000, :infinity, -1, 1.5, "5", nil],
    stream_timeout: [0, 9, :infinity, -3, :never],
    timeout_profile: [:default, :ml_inference, :batch_job, :streaming, :fastest, "default"],
    session_id: [nil, "s-1", "other", @session, 7, :s],
    pool_name: [:default, :p, :q, {:any, "term"}, "p"],
    affinity: [:hint, :strict_queue, :strict_fail_fast, :loose, nil],
    # (:this: this node, node() when the option is drawn.)
    node: [nil, :this, :"b@127.0.0.1", :no_at_sign, "b@127.0.0.1", 5, true],
    bogus: [1]
  }

  defp option do
    case :rand.uniform(20) do
      1 ->
        Enum.random([{"timeout", 5}, :timeout, {:timeout, 1, 2}])

      _ ->
        key = Enum.random(Map.keys(@values))

        case {key, Enum.random(@values[key])} do
          {:node, :this} -> {:node, node()}
          option -> option
        end
    end
  end

  defp options do
    case :rand.uniform(30) do
      1 -> Enum.random([nil, %{timeout: 5}, :timeout, "opts"])
      _ -> for _ <- 1..(:rand.uniform(6) - 1)//1, do: option()
    end
  end

  # The deadline is fixed from the clock: compared as its kind only.
  defp normal({:ok, %Runtime{deadline: d} = rt}) when is_integer(d),
    do: {:ok, %{rt | deadline: :finite}}

  defp normal(other), do: other

  defp both(opts, kind) do
    Application.delete_env(:vllm_bridge, :runtime)
    one_pass = normal(Runtime.resolve(opts, kind))
    Application.put_env(:vllm_bridge, :runtime, affinity: :strict_queue)
    general = normal(Runtime.resolve(opts, kind))
    Application.delete_env(:vllm_bridge, :runtime)
    {one_pass, general}
  end

  test "the one-pass path answers as the general path for 3 000 generated option lists" do
    seed = :erlang.phash2(make_ref())
    :rand.seed(:exsss, {seed, 14, 6})
    on_exit(fn -> Application.delete_env(:vllm_bridge, :runtime) end)

    results =
      for _ <- 1..3_000 do
        opts = options()
        kind = Enum.random([:call, :stream])
        current? = :rand.uniform(3) == 1

        {one_pass, general} =
          if current?,
            do: Session.with_current(@session, fn -> both(opts, kind) end),
            else: both(opts, kind)

        assert one_pass == general,
               "seed #{seed}: #{inspect(opts)} (#{kind}, current session #{current?})"

        elem(one_pass, 0)
      end

    # Both answers were drawn often: the comparison covered resolutions and refusals.
    assert Enum.count(results, &(&1 == :ok)) > 300
    assert Enum.count(results, &(&1 == :error)) > 300
  end
end
