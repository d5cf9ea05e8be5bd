defmodule VllmBridge.Bindings.ArgsFastPathTest do
  @moduledoc """
  `VllmBridge.Bindings.Args.split/3`'s clauses for a function without parameters (no
  options, or only `__runtime__`) answer exactly as its general path, `split_general/3`,
  over generated argument lists: options of every shape, keyword lists and others,
  unknown and repeated keys, `**kwargs` functions, and the `with_…` form's extra argument.
  """
  use ExUnit.Case, async: true

  alias VllmBridge.Bindings.Args

  @specs [
    %{name: "T.none", target: {"m", "none"}, params: []},
    %{name: "T.var", target: {"m", "var"}, params: [], var_keyword: true},
    %{name: "T.one", target: {"m", "one"}, params: [{:a, :optional, :int}]}
  ]

  defp runtime do
    Enum.random([[], [timeout: 5], [pool_name: :p, session_id: "s"], :not_a_list, nil, %{}])
  end

  defp option_list do
    case :rand.uniform(8) do
      1 -> []
      2 -> [__runtime__: runtime()]
      3 -> [__runtime__: runtime(), __runtime__: []]
      4 -> [a: 1]
      5 -> [__runtime__: runtime(), x: 2]
      6 -> [{"__runtime__", []}]
      7 -> [:__runtime__]
      8 -> Enum.random([1, "opts", %{__runtime__: []}, [1, 2]])
    end
  end

  defp args do
    case :rand.uniform(4) do
      1 -> []
      2 -> [option_list()]
      3 -> [option_list(), option_list()]
      4 -> [1, option_list()]
    end
  end

  test "split/3 answers as split_general/3 for 5 000 generated calls" do
    seed = :erlang.phash2(make_ref())
    :rand.seed(:exsss, {seed, 19, 4})

    for _ <- 1..5_000 do
      spec = Enum.random(@specs)
      args = args()
      more = Enum.random([0, 1])

      assert Args.split(spec, args, more) == Args.split_general(spec, args, more),
             "seed #{seed}: #{inspect({spec.name, args, more})}"
    end
  end
end
