defmodule VllmBridge.Bindings.NamingTest do
  @moduledoc "The naming rule of the generated modules, functions and files."
  use ExUnit.Case, async: true

  alias VllmBridge.Bindings.Naming

  test "modules" do
    assert Naming.functions_module("vllm_bridge.forward_context") == Vllm.ForwardContext.Module
    assert Naming.functions_module("vllm_bridge.cudagraph") == Vllm.Cudagraph.Module

    assert Naming.class_module("vllm_bridge.forward_context", "ForwardContext") ==
             Vllm.ForwardContext

    assert Naming.class_module("vllm_bridge.forward_context", "BatchDescriptor") ==
             Vllm.ForwardContext.BatchDescriptor

    assert Naming.class_module("vllm_bridge.config", "ParallelConfig") ==
             Vllm.Config.ParallelConfig

    assert Naming.class_module("vllm_bridge.cudagraph", "CUDAGraphMode") ==
             Vllm.Cudagraph.CUDAGraphMode

    assert Naming.base("vllm_bridge.a_b.c") == "Vllm.AB.C"

    assert_raise ArgumentError, ~r/not a module of vllm_bridge/, fn -> Naming.base("os.path") end
  end

  test "functions, arguments and files" do
    assert Naming.function_name("set_forward_context") == "set_forward_context"
    assert Naming.function_name("_compute_sp_num_tokens") == "_compute_sp_num_tokens"
    assert Naming.function_name("UBatchSlices") == "u_batch_slices"
    assert Naming.function_name("RUNTIME_MODES") == "runtime_modes"
    assert Naming.instance_name("DPMetadata") == "dp_metadata"
    assert Naming.instance_name("CUDAGraphMode") == "cuda_graph_mode"
    assert Naming.variable("end") == "end_"
    assert Naming.variable("_hidden") == "arg_hidden"
    assert Naming.variable("num_tokens") == "num_tokens"

    assert Naming.file(Vllm.ForwardContext.Module, "vllm_bridge.forward_context") ==
             "lib/vllm/forward_context/module.ex"

    assert Naming.file(Vllm.Cudagraph.CUDAGraphMode, "vllm_bridge.cudagraph") ==
             "lib/vllm/cudagraph/cuda_graph_mode.ex"

    # The demo's bindings are rooted in demo/lib/ (compiled in dev and test only).
    assert Naming.file(Vllm.Demo.Rank.Module, "vllm_bridge.demo.rank") ==
             "demo/lib/vllm/demo/rank/module.ex"

    assert Naming.code_root("vllm_bridge.demo") == "demo/lib"
    # A module whose name only starts like the demo's is not the demo's.
    assert Naming.code_root("vllm_bridge.demonstration") == "lib"
    assert Naming.code_root("vllm_bridge.dp") == "lib"
    assert Naming.manifest_file("vllm_bridge.dp") == "priv/bindings/vllm_bridge.dp.json"
  end

  test "a user's modules: every part of the module path under the prefix, files below it" do
    n = Naming.user("MyApp.Py", "lib/my_app/py")
    assert Naming.base("my_model", n) == "MyApp.Py.MyModel"
    assert Naming.base("pkg.sub", n) == "MyApp.Py.Pkg.Sub"
    # The library's package is not special in a user's naming.
    assert Naming.base("vllm_bridge_x.y", n) == "MyApp.Py.VllmBridgeX.Y"
    assert Naming.functions_module("my_model", n) == MyApp.Py.MyModel.Module
    assert Naming.class_module("my_model", "Cfg", n) == MyApp.Py.MyModel.Cfg
    assert Naming.class_module("my_model", "MyModel", n) == MyApp.Py.MyModel
    assert Naming.class_module("pkg.sub", "Sub", n) == MyApp.Py.Pkg.Sub

    assert Naming.file(MyApp.Py.MyModel.Module, "my_model", n) ==
             "lib/my_app/py/my_model/module.ex"

    assert Naming.file(MyApp.Py.MyModel, "my_model", n) == "lib/my_app/py/my_model.ex"
    assert Naming.file(MyApp.Py.Pkg.Sub.Module, "pkg.sub", n) == "lib/my_app/py/pkg/sub/module.ex"
    assert Naming.manifest_file("my_model", n) == nil
    assert Naming.outs(n) == ["lib/my_app/py"]

    # A module outside the prefix has no file there (the prefix is a whole-segment prefix).
    assert_raise ArgumentError, ~r/not a module below MyApp.Py/, fn ->
      Naming.file(MyApp.PyX.Module, "x", n)
    end

    assert_raise ArgumentError, ~r/not a module below MyApp.Py/, fn ->
      Naming.file(MyApp.Py, "x", n)
    end
  end
end
