Code.require_file("../support/bindings_helpers.exs", __DIR__)

defmodule VllmBridge.Runtime.ImproperArgsTest do
  @moduledoc """
  Arguments that are improper lists (`[{:a, 1} | :b]`), as `args` or `kwargs` of
  `VllmBridge.call/4`, of `VllmBridge.Call.Wire.encode_invoke_binding/3` (what a
  generated binding calls) and as a generated binding's options: each is a
  `:bad_argument` naming the value, never a raise, and the pool serves on.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.BindingsHelpers

  alias Vllm.ForwardContext.Module, as: FC
  alias VllmBridge.Call.Wire
  alias VllmBridge.Error

  setup_all do
    start_default_pool!(allow: ["vllm_bridge.bridge.diag", "vllm_bridge.forward_context"])
    :ok
  end

  # -- a small generator of odd terms --------------------------------------------------

  # The tail that makes a list improper: anything but a list.
  defp tail do
    Enum.random([
      :b,
      nil,
      0,
      -7,
      1.5,
      "tail",
      <<0xFF, 1>>,
      %{},
      %{a: 1},
      {:c, 2},
      {},
      self(),
      make_ref()
    ])
  end

  defp pair do
    Enum.random([{:a, 1}, {"b", 2}, {:c, [1 | 2]}, {:d, %{}}, {:e, nil}])
  end

  defp item, do: Enum.random([1, "x", :y, [1], %{"k" => 2}, {1, 2}, pair()])

  # An improper list of 1 to 4 of `gen`'s terms (at least one item: `[] | t` is `t`).
  defp improper(gen) do
    items = for _ <- 1..:rand.uniform(4), do: gen.()
    List.foldr(items, tail(), &[&1 | &2])
  end

  defp odd_kwargs, do: improper(Enum.random([&pair/0, &item/0]))
  defp odd_args, do: improper(&item/0)

  defp seeded do
    seed = :erlang.phash2(make_ref())
    :rand.seed(:exsss, {seed, 3, 1})
    seed
  end

  # `call` runs the call: a raise is reported as such, with the generator's seed.
  defp bad!(call, value, context) do
    result =
      try do
        call.()
      rescue
        e -> {:raised, e}
      end

    context = "#{context}\ngot #{inspect(result)}"
    assert match?({:error, %Error{type: :bad_argument}}, result), context
    {:error, %Error{message: msg}} = result
    # Named: the message shows the list, up to its improper tail.
    assert msg =~ " | #{inspect(improper_tail(value))}]", context
  end

  defp improper_tail([_ | tail]), do: improper_tail(tail)
  defp improper_tail(tail), do: tail

  # -- tests -----------------------------------------------------------------------------

  test "improper kwargs and args are :bad_argument naming them, from encode_invoke_binding" do
    # The auditor's: every pair well formed, the tail not a list.
    kw = [{:a, 1} | :b]
    bad!(fn -> Wire.encode_invoke_binding({"m", "f"}, [], kw) end, kw, "the auditor's")

    seed = seeded()

    for _ <- 1..500 do
      kw = odd_kwargs()
      args = odd_args()
      context = "seed #{seed}: #{inspect({args, kw})}"

      bad!(fn -> Wire.encode_invoke_binding({"m", "f"}, [1], kw) end, kw, context)
      bad!(fn -> Wire.encode_invoke({"m", "f"}, [], kw) end, kw, context)
      bad!(fn -> Wire.encode_invoke_binding({"m", "f"}, args, %{}) end, args, context)
    end
  end

  test "improper kwargs and args through VllmBridge.call; the pool serves on" do
    seed = seeded()
    add = {"vllm_bridge.bridge.diag", "add"}

    for _ <- 1..200 do
      kw = odd_kwargs()
      args = odd_args()
      context = "seed #{seed}: #{inspect({args, kw})}"

      bad!(fn -> VllmBridge.call(add, [1, 2], kw) end, kw, context)
      bad!(fn -> VllmBridge.call(add, args, %{}) end, args, context)
    end

    assert {:ok, 3} =
             VllmBridge.call(add, [1, 2], a: nil)
             |> then(fn _ -> VllmBridge.call(add, [1, 2]) end)
  end

  test "a generated binding given improper options or runtime options refuses them by name" do
    seed = seeded()

    for _ <- 1..200 do
      kw = odd_kwargs()
      context = "seed #{seed}: #{inspect(kw)}"

      bad!(fn -> FC.is_forward_context_available(kw) end, kw, context)

      assert {:error, %Error{type: :bad_argument}} =
               FC.is_forward_context_available(__runtime__: kw),
             context
    end

    assert {:ok, false} = FC.is_forward_context_available()
  end
end
