defmodule VllmBridge.Bindings.SeedFunctionsTest do
  @moduledoc """
  Every function and arity of the seed's `Vllm.ForwardContext.Module` is bound. The heads
  are read from seed_functions.txt (copied from seeds/elixir_bindings_forward_context.txt),
  so a binding that the generator stops writing (a name left out of the module's exports)
  fails here, with the head that lost it.
  """
  use ExUnit.Case, async: true

  @heads Path.join(__DIR__, "seed_functions.txt")
  @external_resource @heads

  # [{head, name, arities}] of the heads in the file.
  defp heads do
    for line <- File.read!(@heads) |> String.split("\n", trim: true),
        not String.starts_with?(line, "#") do
      [_, name, args] = Regex.run(~r/^(\w+)\((.*)\)$/, line)
      args = if args == "", do: [], else: String.split(args, ", ")
      n = length(args)

      arities =
        if args != [] and String.ends_with?(List.last(args), "\\\\ []"),
          do: [n - 1, n],
          else: [n]

      {line, String.to_atom(name), arities}
    end
  end

  test "the seed's heads are read (all 18 names; create_forward_context from 2 to 9)" do
    heads = heads()
    assert heads |> Enum.map(&elem(&1, 1)) |> Enum.uniq() |> length() == 18

    assert for({_, :create_forward_context, arities} <- heads, do: arities) |> List.flatten() ==
             Enum.to_list(2..9)

    assert {"get_forward_context(opts \\\\ [])", :get_forward_context, [0, 1]} in heads
  end

  test "every seed function is bound at each of its arities" do
    Code.ensure_loaded!(Vllm.ForwardContext.Module)

    missing =
      for {head, name, arities} <- heads(),
          arity <- arities,
          not function_exported?(Vllm.ForwardContext.Module, name, arity),
          do: "#{name}/#{arity} (seed: #{head})"

    assert missing == []
  end
end
