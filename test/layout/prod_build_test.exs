defmodule VllmBridge.Layout.ProdBuildTest do
  @moduledoc """
  A user's build (`MIX_ENV=prod mix compile`) holds the bridge and the `Vllm` bindings,
  and none of the demo or the benchmarks: bench/lib/ and demo/lib/ are compiled only in
  dev and test (`elixirc_paths` in mix.exs). Compiled for real, in a build path of its own,
  and without a warning.
  """
  use ExUnit.Case, async: true

  alias VllmBridge.Bindings.{Generator, Naming}

  @moduletag timeout: 600_000

  setup_all do
    build = Path.join(System.tmp_dir!(), "vllm_prod_build_#{System.unique_integer([:positive])}")
    on_exit(fn -> File.rm_rf!(build) end)

    {output, status} =
      System.cmd("mix", ["compile", "--force"],
        env: [{"MIX_ENV", "prod"}, {"MIX_BUILD_PATH", build}],
        stderr_to_stdout: true
      )

    modules =
      build
      |> Path.join("lib/vllm_bridge/ebin/*.beam")
      |> Path.wildcard()
      |> Enum.map(&(&1 |> Path.basename(".beam") |> String.to_atom()))

    %{output: output, status: status, modules: modules, build: build}
  end

  test "MIX_ENV=prod mix compile succeeds without a warning", %{output: output, status: status} do
    assert status == 0, output
    refute output =~ ~r/warning/i, output
  end

  test "the prod build has the bridge and the bindings, and no demo or bench module", %{
    modules: modules
  } do
    # The demo's generated bindings, whatever the demo's Python modules are called.
    demo_bindings =
      for {python, _} <- Generator.modules(),
          Naming.code_root(python) == "demo/lib",
          do: Naming.functions_module(python)

    assert demo_bindings != []

    for module <- [
          VllmBridge,
          VllmBridge.Bindings.Generator,
          Mix.Tasks.Vllm.Gen.Bindings,
          Vllm.ForwardContext.Module,
          Vllm.Dp.Module
        ],
        do: assert(module in modules, inspect(module))

    dev_only =
      Enum.filter(modules, fn module ->
        name = inspect(module)

        module in demo_bindings or
          Enum.any?(
            ~w(VllmBridge.Bench VllmBridge.Demo Mix.Tasks.Vllm.Bench Mix.Tasks.Vllm.Demo Vllm.Demo),
            &(name == &1 or String.starts_with?(name, &1 <> "."))
          )
      end)

    assert dev_only == []
  end

  test "the app file lists exactly the modules compiled", %{build: build, modules: modules} do
    {:ok, [{:application, :vllm_bridge, app}]} =
      :file.consult(String.to_charlist(Path.join(build, "lib/vllm_bridge/ebin/vllm_bridge.app")))

    assert Enum.sort(app[:modules]) == Enum.sort(modules)
  end
end
