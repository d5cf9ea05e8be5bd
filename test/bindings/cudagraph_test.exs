Code.require_file("../support/bindings_helpers.exs", __DIR__)

defmodule VllmBridge.Bindings.CudagraphTest do
  @moduledoc """
  `Vllm.Cudagraph.Module` and the enum `Vllm.Cudagraph.CUDAGraphMode` (a type of atoms,
  with the enum's methods bound: the worker turns the atom into the member) on a real
  worker.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.BindingsHelpers

  alias Vllm.Cudagraph.CUDAGraphMode, as: Mode
  alias Vllm.Cudagraph.Module, as: CG
  alias VllmBridge.{Error, Ref}

  setup_all do
    start_default_pool!()
    :ok
  end

  test "the bindings and their arities" do
    assert exported(CG) == %{cudagraph_mode_from: 1..3, runtime_modes: 0..1}

    assert exported(Mode) == %{
             decode_mode: 1..2,
             has_full_cudagraphs: 1..2,
             has_mode: 2..3,
             has_piecewise_cudagraphs: 1..2,
             max_cudagraph_mode: 1..2,
             mixed_mode: 1..2,
             requires_piecewise_compilation: 1..2,
             separate_routine: 1..2,
             valid_runtime_modes: 1..2
           }

    assert Mode.__members__() == [
             :none,
             :piecewise,
             :full,
             :full_decode_only,
             :full_and_piecewise
           ]

    assert Mode.__python_class__() == "vllm_bridge.cudagraph.CUDAGraphMode"
  end

  test "enum members come back as atoms" do
    assert CG.cudagraph_mode_from(:full) == {:ok, :full}
    assert CG.cudagraph_mode_from("FULL_AND_PIECEWISE") == {:ok, :full_and_piecewise}
    assert CG.cudagraph_mode_from(1, "mode") == {:ok, :piecewise}
    assert CG.cudagraph_mode_from(2, "mode", []) == {:ok, :full}
    assert CG.cudagraph_mode_from(0, name: "m") == {:ok, :none}

    assert {:error, %Error{type: :python_exception, message: m}} =
             CG.cudagraph_mode_from(7, "my_mode")

    assert m =~ "my_mode: unknown CUDAGraphMode value 7"
    assert {:error, %Error{type: :bad_argument, message: m}} = CG.cudagraph_mode_from(:fast)

    assert m =~
             "value must be Vllm.Cudagraph.CUDAGraphMode.t() | String.t() | integer(), got :fast"

    assert {:ok, %Ref{type: "builtins.frozenset"}} = CG.runtime_modes()
    assert {:ok, %Ref{}} = CG.runtime_modes(__runtime__: [timeout: 10_000])
  end

  test "the enum's methods, on every member" do
    expected = %{
      none: {false, :none, :none, :none, false, false, true},
      piecewise: {false, :piecewise, :piecewise, :piecewise, false, true, true},
      full: {false, :full, :full, :full, true, false, true},
      full_decode_only: {true, :full, :none, :full, true, false, false},
      full_and_piecewise: {true, :full, :piecewise, :full, true, true, false}
    }

    methods = [
      :separate_routine,
      :decode_mode,
      :mixed_mode,
      :max_cudagraph_mode,
      :has_full_cudagraphs,
      :has_piecewise_cudagraphs,
      :valid_runtime_modes
    ]

    for mode <- Mode.__members__(), opts <- [nil, [], [__runtime__: [timeout: 10_000]]] do
      args = if opts, do: [mode, opts], else: [mode]
      results = for m <- methods, do: apply(Mode, m, args)
      {separate, decode, mixed, max, full, piecewise, valid} = expected[mode]

      assert results ==
               Enum.map([separate, decode, mixed, max, full, piecewise, valid], &{:ok, &1})

      assert apply(Mode, :requires_piecewise_compilation, args) == {:ok, piecewise}
    end

    assert Mode.has_mode(:full_and_piecewise, :piecewise) == {:ok, true}
    assert Mode.has_mode(:full_decode_only, :piecewise, []) == {:ok, false}

    assert {:error, %Error{type: :python_exception, message: m}} =
             Mode.has_mode(:full, :full_decode_only)

    assert m =~ "has_mode expects a plain mode"
    assert {:error, %Error{type: :bad_argument, message: m}} = Mode.decode_mode(:sideways)

    assert m =~
             "decode_mode/1: cuda_graph_mode must be Vllm.Cudagraph.CUDAGraphMode.t(), got :sideways"

    assert {:error, %Error{type: :bad_argument}} = Mode.decode_mode("full")
  end
end
