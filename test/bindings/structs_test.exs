Code.require_file("../support/bindings_helpers.exs", __DIR__)

defmodule VllmBridge.Bindings.StructsTest do
  @moduledoc """
  The generated structs on real workers: every field, typed and defaulted as in Python,
  built in Elixir and round-tripped through Python (which checks and normalises them),
  and the methods bound in their modules: `DPMetadata` (`make`, the `chunked_sizes` and
  `sp_local_sizes` context managers in both forms, ...) and `BatchDescriptor`.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.BindingsHelpers

  alias Vllm.Config.{CompilationConfig, ParallelConfig, VllmConfig}
  alias Vllm.ForwardContext.{BatchDescriptor, DPMetadata}
  alias VllmBridge.{Error, Session, Tensor}

  setup_all do
    start_default_pool!()
    :ok
  end

  # A value through Python and back (diag.echo builds the dataclass, then encodes it).
  defp echo(value), do: VllmBridge.call({"vllm_bridge.bridge.diag", "echo"}, [value])

  test "fields, defaults and the registry entries follow Python" do
    assert BatchDescriptor.__python_fields__() == [
             :num_tokens,
             :num_reqs,
             :uniform,
             :has_lora,
             :num_active_loras
           ]

    assert BatchDescriptor.__python_class__() == "vllm_bridge.forward_context.BatchDescriptor"

    assert %BatchDescriptor{num_tokens: 1} == %BatchDescriptor{
             num_tokens: 1,
             num_reqs: nil,
             uniform: false,
             has_lora: false,
             num_active_loras: 0
           }

    assert_raise ArgumentError, ~r/num_tokens/, fn -> struct!(BatchDescriptor, []) end

    assert %VllmConfig{}.parallel_config == %ParallelConfig{}
    assert %ParallelConfig{}.dbo_prefill_token_threshold == 512
    assert %CompilationConfig{}.cudagraph_mode == :none

    assert %Vllm.ForwardContext{
             no_compile_layers: %{},
             attn_metadata: nil,
             slot_mapping: %{},
             virtual_engine: 0
           }.additional_kwargs == %{}

    for module <- [
          BatchDescriptor,
          DPMetadata,
          Vllm.ForwardContext,
          ParallelConfig,
          CompilationConfig,
          VllmConfig,
          Vllm.Ubatch.UBatchSlice,
          Vllm.Dp.DPGroupInfo
        ] do
      assert VllmBridge.Codec.Registry.registered()[module.__python_class__()] == module

      assert (Map.keys(struct(module)) -- [:__struct__]) |> Enum.sort() ==
               Enum.sort(module.__python_fields__())
    end
  end

  test "every struct round-trips through Python, which builds and checks it" do
    for value <- [
          %BatchDescriptor{
            num_tokens: 8,
            num_reqs: 2,
            uniform: true,
            has_lora: true,
            num_active_loras: 1
          },
          %ParallelConfig{
            data_parallel_size: 2,
            data_parallel_rank: 1,
            is_moe_model: true,
            enable_dbo: true
          },
          %VllmConfig{
            compilation_config: %CompilationConfig{
              cudagraph_mode: :full_and_piecewise,
              cudagraph_capture_sizes: [1, 8],
              max_cudagraph_capture_size: 8
            }
          },
          %Vllm.Dp.DPGroupInfo{
            rank: 0,
            world_size: 1,
            master_addr: "127.0.0.1",
            master_port: 1,
            backend: "gloo",
            timeout_s: 5.0
          }
        ] do
      assert echo(value) == {:ok, value}
    end

    # Python normalises what it is given: sorted capture sizes, the default maximum.
    assert {:ok,
            %CompilationConfig{cudagraph_capture_sizes: [1, 4, 8], max_cudagraph_capture_size: 8}} =
             echo(%CompilationConfig{cudagraph_capture_sizes: [8, 1, 4, 8]})
  end

  test "Python refuses a struct with a bad field, naming it" do
    assert {:error, %Error{type: :bad_argument, message: m}} =
             echo(%ParallelConfig{data_parallel_size: 2, data_parallel_rank: 2})

    assert m =~ "data_parallel_rank must be < data_parallel_size (2), got 2"

    assert {:error, %Error{type: :bad_argument, message: m}} =
             echo(%BatchDescriptor{num_tokens: "8"})

    assert m =~ "BatchDescriptor.num_tokens must be an int"

    assert {:error, %Error{type: :bad_argument, message: m}} =
             echo(%CompilationConfig{cudagraph_mode: :sometimes})

    assert m =~ ":sometimes is not a member"
  end

  test "BatchDescriptor.relax_for_mixed_batch_cudagraphs" do
    bd = %BatchDescriptor{
      num_tokens: 8,
      num_reqs: 2,
      uniform: true,
      has_lora: true,
      num_active_loras: 3
    }

    relaxed = %BatchDescriptor{num_tokens: 8, has_lora: true, num_active_loras: 3}
    assert BatchDescriptor.relax_for_mixed_batch_cudagraphs(bd) == {:ok, relaxed}

    assert BatchDescriptor.relax_for_mixed_batch_cudagraphs(bd, __runtime__: [timeout: 10_000]) ==
             {:ok, relaxed}

    assert {:error, %Error{type: :bad_argument, message: m}} =
             BatchDescriptor.relax_for_mixed_batch_cudagraphs(%{num_tokens: 8})

    assert m =~
             "relax_for_mixed_batch_cudagraphs/1: batch_descriptor must be Vllm.ForwardContext.BatchDescriptor.t(), got %{num_tokens: 8}"
  end

  defp meta do
    pc = %ParallelConfig{data_parallel_size: 2, data_parallel_rank: 0}
    {:ok, meta} = DPMetadata.make(pc, 5, Tensor.from_list([5, 3], :int32))
    meta
  end

  test "DPMetadata.make, cu_tokens_across_sp, get_chunk_sizes_across_dp_rank" do
    pc = %ParallelConfig{data_parallel_size: 2, data_parallel_rank: 0}
    meta = meta()
    assert Tensor.to_list(meta.num_tokens_across_dp_cpu) == [5, 3]
    assert Tensor.to_list(meta.max_tokens_across_dp_cpu) == 5
    assert meta.local_sizes == nil
    assert {:ok, ^meta} = DPMetadata.make(pc, 5, Tensor.from_list([5, 3], :int32), [])

    assert {:error, %Error{type: :python_exception, message: m}} =
             DPMetadata.make(%ParallelConfig{}, 5, Tensor.from_list([5], :int32))

    assert m =~ "data_parallel_size > 1"

    assert {:ok, cu} = DPMetadata.cu_tokens_across_sp(meta, 2)
    assert Tensor.to_list(cu) == [3, 6, 8, 10]
    assert {:ok, cu1} = DPMetadata.cu_tokens_across_sp(meta, 1, [])
    assert Tensor.to_list(cu1) == [5, 8]

    assert {:error, %Error{type: :python_exception, python_type: "RuntimeError"}} =
             DPMetadata.get_chunk_sizes_across_dp_rank(meta)

    assert DPMetadata.get_chunk_sizes_across_dp_rank(%{meta | local_sizes: [2, 2]}, []) ==
             {:ok, [2, 2]}
  end

  test "DPMetadata.chunked_sizes and sp_local_sizes: plain form (entered, handle) and with_ form" do
    meta = meta()
    s = session!()
    rt = [__runtime__: [session_id: s]]

    assert {:ok, {handle, [4, 3]}} = DPMetadata.chunked_sizes(meta, 1, 4, 0, rt)
    assert {:ok, false} = VllmBridge.exit(handle, nil, session_id: s)
    assert {:error, %Error{type: :bad_argument}} = DPMetadata.chunked_sizes(meta, 1, 4, 1)

    VllmBridge.with_session(fn _ ->
      assert {:ok, {handle, [1, 1]}} = DPMetadata.chunked_sizes(meta, 1, 4, 1)
      assert {:ok, false} = VllmBridge.exit(handle)
      assert {:ok, {handle, [3, 3, 2, 2]}} = DPMetadata.sp_local_sizes(meta, 2)
      assert {:ok, false} = VllmBridge.exit(handle)
    end)

    assert {:ok, {handle, [5, 3]}} = DPMetadata.sp_local_sizes(meta, 1, rt)
    assert {:ok, false} = VllmBridge.exit(handle, nil, session_id: s)

    assert DPMetadata.with_chunked_sizes(meta, 2, 2, 1, fn sizes -> sizes end) ==
             {:ok, [1, 1, 1, 1]}

    assert {:ok, {[2, 2, 2, 2], %Session{}}} =
             DPMetadata.with_chunked_sizes(meta, 2, 2, 0, [], &{&1, &2})

    assert DPMetadata.with_sp_local_sizes(meta, 2, &Enum.sum/1) == {:ok, 10}
    assert {:ok, {[5, 3], ^s}} = DPMetadata.with_sp_local_sizes(meta, 1, rt, &{&1, &2})

    assert_raise ArgumentError, "inside", fn ->
      DPMetadata.with_sp_local_sizes(meta, 1, rt, fn _ -> raise ArgumentError, "inside" end)
    end

    assert {:error, %Error{type: :python_exception, message: m}} =
             DPMetadata.with_chunked_sizes(meta, 1, 0, 0, fn _ -> flunk("ran") end)

    assert m =~ "max_num_tokens must be >= 1"

    assert {:error, %Error{type: :bad_argument, message: m}} =
             DPMetadata.with_sp_local_sizes(meta, 1, [chunk: 1], fn _ -> :ok end)

    assert m =~ "with_sp_local_sizes/4: unknown option :chunk"
  end

  test "the DP metadata of a forward context travels with it" do
    s = session!()
    rt = [__runtime__: [session_id: s]]

    cfg = %VllmConfig{
      parallel_config: %ParallelConfig{data_parallel_size: 2, data_parallel_rank: 1}
    }

    counts = Tensor.from_list([3, 5], :int32)

    assert {:ok,
            %Vllm.ForwardContext{dp_metadata: %DPMetadata{num_tokens_across_dp_cpu: ^counts}} =
              ctx} =
             Vllm.ForwardContext.Module.with_set_forward_context(
               nil,
               cfg,
               0,
               5,
               counts,
               rt,
               fn _ ->
                 {:ok, ctx} = Vllm.ForwardContext.Module.get_forward_context(rt)
                 ctx
               end
             )

    # The whole context, DP metadata and tensors included, goes back to Python by value.
    assert {:ok, {h, nil}} = Vllm.ForwardContext.Module.override_forward_context(ctx, rt)
    assert Vllm.ForwardContext.Module.get_forward_context(rt) == {:ok, ctx}
    assert {:ok, false} = VllmBridge.exit(h, nil, session_id: s)
  end
end
