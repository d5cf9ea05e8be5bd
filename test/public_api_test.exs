defmodule VllmBridge.PublicApiTest do
  @moduledoc """
  The public API is exactly what README.md teaches: the `VllmBridge.*` modules that have
  a moduledoc are those of its list "Public modules", and every other one is
  `@moduledoc false`. The generated bindings (`Vllm.*`) and the benchmark and demo code
  (`VllmBridge.Bench*`, `VllmBridge.Demo*`, compiled only in dev and test) are outside
  this rule.
  """
  use ExUnit.Case, async: true

  @readme Path.expand("../README.md", __DIR__)

  # The modules of README.md's "Public modules" list (`- `Module` - what it is`).
  defp readme_modules do
    [_, section] = String.split(File.read!(@readme), "### Public modules\n", parts: 2)

    Regex.scan(~r/^- `([A-Za-z.]+)` - /m, section)
    |> Enum.map(fn [_, name] -> Module.concat([name]) end)
  end

  defp bridge_module?(module) do
    name = inspect(module)

    (name == "VllmBridge" or String.starts_with?(name, "VllmBridge.")) and
      not String.starts_with?(name, ["VllmBridge.Bench", "VllmBridge.Demo"])
  end

  # A module with a moduledoc, or with none written (which documentation tools show too).
  defp public?(module) do
    case Code.fetch_docs(module) do
      {:docs_v1, _, _, _, :hidden, _, _} -> false
      {:docs_v1, _, _, _, _doc, _, _} -> true
    end
  end

  test "the VllmBridge.* modules with a moduledoc are exactly README.md's public list" do
    {:ok, modules} = :application.get_key(:vllm_bridge, :modules)
    public = modules |> Enum.filter(&bridge_module?/1) |> Enum.filter(&public?/1)
    listed = readme_modules()

    assert length(listed) == length(Enum.uniq(listed)), "README lists a module twice"
    assert listed != []
    assert Enum.sort(public) == Enum.sort(listed)
  end
end
