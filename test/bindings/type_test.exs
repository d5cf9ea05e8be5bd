defmodule VllmBridge.Bindings.TypeTest do
  @moduledoc "Manifest types -> descriptors -> typespecs, and argument checks."
  use ExUnit.Case, async: true

  alias VllmBridge.Bindings.Type
  alias VllmBridge.{Object, Ref, Tensor}

  @classes %{
    "vllm_bridge.config.VllmConfig" => Vllm.Config.VllmConfig,
    "vllm_bridge.cudagraph.CUDAGraphMode" => Vllm.Cudagraph.CUDAGraphMode
  }

  defp t(kind, more \\ %{}), do: Map.put(more, "kind", kind)

  test "every manifest kind maps to a descriptor and a typespec" do
    cases = [
      {t("any"), :any, "term()"},
      {t("none"), :none, "nil"},
      {t("bool"), :bool, "boolean()"},
      {t("int"), :int, "integer()"},
      {t("float"), :float, "float()"},
      {t("str"), :str, "String.t()"},
      {t("bytes"), :bytes, "binary()"},
      {t("tensor"), :tensor, "VllmBridge.Tensor.t()"},
      {t("list", %{"item" => t("int")}), {:list, :int}, "[integer()]"},
      {t("dict", %{"key" => t("str"), "value" => t("any")}), {:dict, :str, :any},
       "%{optional(String.t()) => term()}"},
      {t("tuple", %{"items" => [t("bool"), t("int")]}), {:tuple, [:bool, :int]},
       "{boolean(), integer()}"},
      {t("tuple", %{"item" => t("int")}), {:tuple_of, :int}, "tuple()"},
      {t("union", %{"of" => [t("int"), t("none")]}), {:union, [:int, :none]}, "integer() | nil"},
      {t("dataclass", %{"class" => "vllm_bridge.config.VllmConfig"}),
       {:struct, Vllm.Config.VllmConfig}, "Vllm.Config.VllmConfig.t()"},
      {t("dataclass", %{"class" => "vllm_bridge.bridge.diag.Sample"}),
       {:object, "vllm_bridge.bridge.diag.Sample"}, "VllmBridge.Object.t()"},
      {t("enum", %{
         "class" => "vllm_bridge.cudagraph.CUDAGraphMode",
         "members" => ["NONE", "FULL"]
       }), {:enum, Vllm.Cudagraph.CUDAGraphMode, [:none, :full]},
       "Vllm.Cudagraph.CUDAGraphMode.t()"},
      {t("enum", %{"class" => "x.Color", "members" => ["RED"]}), {:enum, nil, [:red]}, ":red"},
      {t("ref", %{"class" => "logging.Logger"}), {:ref, "logging.Logger"}, "VllmBridge.Ref.t()"},
      {t("ref", %{"class" => "slice"}), :slice, "{integer(), integer()} | VllmBridge.Ref.t()"}
    ]

    for {manifest, desc, spec} <- cases do
      assert Type.from_manifest(manifest, @classes) == desc
      assert Type.spec(desc) == spec
    end
  end

  test "an unknown kind is refused" do
    assert_raise ArgumentError, ~r/unknown type kind "weird"/, fn ->
      Type.from_manifest(t("weird"), %{})
    end
  end

  test "every typespec is valid Elixir" do
    for desc <- [{:dict, {:union, [:int, :none]}, {:list, :float}}, {:tuple, []}, :slice] do
      assert {:ok, _} = Code.string_to_quoted("@type x :: " <> Type.spec(desc))
    end
  end

  test "checks follow the types" do
    tensor = Tensor.from_list([1, 2], :int32)

    yes = [
      {:any, self()},
      {:none, nil},
      {:bool, false},
      {:int, -3},
      {:float, 1.5},
      {:float, 2},
      {:float, :nan},
      {:str, "é"},
      {:bytes, <<0xFF>>},
      {:tensor, tensor},
      {:slice, {0, 4}},
      {{:list, :int}, [1, 2]},
      {{:list, :int}, []},
      {{:dict, :str, {:list, :float}}, %{"a" => [1.0]}},
      {{:tuple, [:bool, :int]}, {true, 1}},
      {{:tuple_of, :int}, {1, 2, 3}},
      {{:union, [:int, :none]}, nil},
      {{:struct, Vllm.Config.VllmConfig}, %Vllm.Config.VllmConfig{}},
      {{:object, "x.Y"}, %Object{class: "x.Y"}},
      {{:enum, nil, [:none, :full]}, :full},
      {{:ref, "logging.Logger"}, %Ref{instance: "i", id: 1}},
      {:int, %Ref{instance: "i", id: 1}}
    ]

    no = [
      {:none, false},
      {:bool, nil},
      {:int, 1.0},
      {:int, true},
      {:float, "1"},
      {:str, <<0xFF>>},
      {:str, :atom},
      {:tensor, [1, 2]},
      {:slice, {0, :x}},
      {:slice, [0, 1]},
      {{:list, :int}, [1, "2"]},
      {{:list, :int}, [1 | 2]},
      {{:dict, :str, :int}, %{a: 1}},
      {{:dict, :str, :int}, %Vllm.Config.VllmConfig{}},
      {{:tuple, [:bool, :int]}, {true}},
      {{:union, [:int, :none]}, "x"},
      {{:struct, Vllm.Config.VllmConfig}, %Vllm.Config.ParallelConfig{}},
      {{:struct, Vllm.Config.VllmConfig}, %{}},
      {{:object, "x.Y"}, %Object{class: "x.Z"}},
      {{:enum, nil, [:none, :full]}, :fuller},
      {{:enum, nil, [:none, :full]}, "full"},
      {{:ref, "logging.Logger"}, "logger"}
    ]

    for {type, v} <- yes,
        do: assert(Type.check(type, v), "#{inspect(type)} should take #{inspect(v)}")

    for {type, v} <- no,
        do: refute(Type.check(type, v), "#{inspect(type)} should refuse #{inspect(v)}")
  end
end
