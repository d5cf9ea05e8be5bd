Code.require_file("../support/bindings_helpers.exs", __DIR__)

defmodule VllmBridge.Bindings.ForwardContextModuleTest do
  @moduledoc """
  `Vllm.ForwardContext.Module` on a real worker: its functions and arities (the seed's,
  more where our Python has more parameters), the module attributes, batch-size
  tracking, the token-count helpers, DP metadata, and `u_batch_slices`. The context
  managers are in forward_context_contexts_test.exs.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.BindingsHelpers

  alias Vllm.ForwardContext.Module, as: FC
  alias Vllm.Config.{ParallelConfig, VllmConfig}
  alias Vllm.Ubatch.UBatchSlice
  alias VllmBridge.{Error, Ref, Tensor}

  setup_all do
    start_default_pool!()
    :ok
  end

  @seed %{
    _compute_chunked_local_num_tokens: 4..5,
    _compute_sp_num_tokens: 2..3,
    _forward_context: 0..1,
    batchsize_forward_time: 0..1,
    batchsize_logging_interval: 0..1,
    coordinate_batch_across_dp: 4..9,
    create_forward_context: 2..11,
    current_platform: 0..1,
    forward_start_time: 0..1,
    get_forward_context: 0..1,
    init_logger: 1..2,
    is_forward_context_available: 0..1,
    last_logging_time: 0..1,
    logger: 0..1,
    override_forward_context: 1..2,
    set_forward_context: 2..11,
    track_batchsize: 0..1,
    u_batch_slices: 0..2
  }

  test "every function of the seed, with its arities (more where Python has more parameters)" do
    exported = exported(FC)

    for {name, range} <- @seed do
      assert Map.fetch(exported, name) == {:ok, range}, "#{name}"
      assert contiguous?(FC, name, range)
    end

    # Ours beyond the seed: the with_ forms and the batch-size functions (not the module's
    # private helpers, such as _make_dp_metadata: it does not export them).
    assert Map.drop(exported, Map.keys(@seed)) == %{
             configure_batchsize_tracking: 1..2,
             get_batchsize_stats: 0..2,
             reset_batchsize_stats: 0..1,
             with_override_forward_context: 2..3,
             with_set_forward_context: 3..12
           }
  end

  @make_dp_metadata {"vllm_bridge.forward_context", "_make_dp_metadata"}

  test "module attributes: read live, in the session's worker" do
    s = session!()
    rt = [__runtime__: [session_id: s]]
    assert FC._forward_context() == {:ok, nil}
    assert FC._forward_context(rt) == {:ok, nil}
    assert {:ok, false} = FC.track_batchsize()
    assert {:ok, interval} = FC.batchsize_logging_interval(rt)
    assert interval < 0
    assert FC.batchsize_logging_interval() == {:ok, interval}
    assert {:ok, %{}} = FC.batchsize_forward_time()
    assert {:ok, t0} = FC.forward_start_time(rt)
    assert is_float(t0)
    assert {:ok, t0b} = FC.forward_start_time()
    assert is_float(t0b)
    assert {:ok, t1} = FC.last_logging_time()
    assert is_float(t1)
    assert {:ok, %Ref{type: "logging.Logger"}} = FC.logger()
    assert {:ok, %Ref{type: "vllm_bridge.platforms.Platform"}} = FC.current_platform(rt)
    assert {:ok, %Ref{type: "vllm_bridge.platforms.Platform"}} = FC.current_platform()

    {:ok, {handle, nil}} = FC.set_forward_context(nil, %VllmConfig{}, 3, rt)
    assert {:ok, %Vllm.ForwardContext{virtual_engine: 3}} = FC._forward_context(rt)
    assert {:ok, false} = VllmBridge.exit(handle, nil, session_id: s)
    assert FC._forward_context(rt) == {:ok, nil}
  end

  test "attributes take only __runtime__ options" do
    assert {:error, %Error{type: :bad_argument, message: m}} = FC.track_batchsize(x: 1)
    assert m =~ "track_batchsize/1: unknown option :x; known: :__runtime__"
    assert {:error, %Error{type: :bad_argument}} = FC.logger(:nope)
    assert {:error, %Error{type: :bad_argument, message: m}} = FC.logger(__runtime__: [bad: 1])
    assert m =~ "unknown runtime option :bad"
  end

  test "batch-size tracking, on one worker" do
    s = session!()
    rt = [__runtime__: [session_id: s]]

    try do
      assert FC.configure_batchsize_tracking(0.0) == {:ok, nil}
      assert FC.reset_batchsize_stats(rt) == {:ok, nil}
      assert {:ok, true} = FC.track_batchsize(rt)
      assert {:ok, +0.0} = FC.batchsize_logging_interval(rt)

      for n <- [4, 4, 8] do
        {:ok, _} =
          FC.with_set_forward_context(%{"layer" => 1}, %VllmConfig{}, 0, n, rt, fn _ -> :ok end)
      end

      assert {:ok, times} = FC.batchsize_forward_time(rt)
      assert Map.keys(times) |> Enum.sort() == [4, 8]
      assert length(times[4]) == 2 and Enum.all?(times[4], &is_float/1)
      assert {:ok, started} = FC.forward_start_time(rt)
      assert started > 0
      assert {:ok, logged} = FC.last_logging_time(rt)
      assert logged > 0
      assert {:ok, [{4, 2, median}]} = FC.get_batchsize_stats(rt)
      assert is_float(median)
      assert {:ok, [{4, 2, _}, {8, 1, _}]} = FC.get_batchsize_stats(1)
      assert {:ok, [{4, 2, _}, {8, 1, _}]} = FC.get_batchsize_stats(1, rt)
      assert {:ok, []} = FC.get_batchsize_stats(min_count: 3, __runtime__: [session_id: s])
      assert FC.get_batchsize_stats() == FC.get_batchsize_stats(rt)
      assert FC.reset_batchsize_stats() == {:ok, nil}
      assert {:ok, []} = FC.get_batchsize_stats(1, rt)
    after
      FC.configure_batchsize_tracking(-1, rt)
    end

    assert {:ok, false} = FC.track_batchsize(rt)

    assert {:error, %Error{type: :bad_argument, message: m}} =
             FC.configure_batchsize_tracking("1")

    assert m =~ ~s|interval_s must be float(), got "1"|
    assert {:error, %Error{type: :python_exception}} = FC.get_batchsize_stats(0)
  end

  test "is_forward_context_available and get_forward_context" do
    s = session!()
    rt = [__runtime__: [session_id: s]]
    assert FC.is_forward_context_available() == {:ok, false}
    assert FC.is_forward_context_available(rt) == {:ok, false}

    assert {:error, %Error{type: :python_exception, python_type: "RuntimeError", message: m}} =
             FC.get_forward_context()

    assert m =~ "Forward context is not set"
    assert {:error, %Error{type: :python_exception}} = FC.get_forward_context(rt)
    assert {:error, %Error{type: :bad_argument, message: m}} = FC.get_forward_context(:bad)

    assert m =~
             "get_forward_context/1: the last argument must be a keyword list of options, got :bad"
  end

  test "init_logger" do
    assert {:ok, %Ref{type: "logging.Logger"}} = FC.init_logger("vllm_bridge.test")
    assert {:ok, %Ref{}} = FC.init_logger("x", __runtime__: [timeout: 10_000])
    assert {:error, %Error{type: :bad_argument, message: m}} = FC.init_logger(5)
    assert m =~ "init_logger/1: name must be String.t(), got 5"
  end

  test "_compute_sp_num_tokens and _compute_chunked_local_num_tokens" do
    counts = Tensor.from_list([5, 3], :int64)
    assert FC._compute_sp_num_tokens(counts, 2) == {:ok, [3, 3, 2, 2]}
    assert FC._compute_sp_num_tokens(counts, 1, __runtime__: [timeout: 5_000]) == {:ok, [5, 3]}
    assert FC._compute_chunked_local_num_tokens(counts, 1, 4, 0) == {:ok, [4, 3]}
    assert FC._compute_chunked_local_num_tokens(counts, 1, 4, 1, []) == {:ok, [1, 1]}

    assert {:error, %Error{type: :python_exception, python_type: "ValueError", message: m}} =
             FC._compute_sp_num_tokens(counts, 0)

    assert m =~ "sequence_parallel_size must be >= 1, got 0"

    # Python takes the counts as a tensor or a list of ints, and so do the bindings.
    assert FC._compute_sp_num_tokens([5, 3], 2) == {:ok, [3, 3, 2, 2]}
    assert FC._compute_chunked_local_num_tokens([5, 3], 1, 4, 1) == {:ok, [1, 1]}

    assert {:error, %Error{type: :bad_argument, message: m}} =
             FC._compute_sp_num_tokens("5, 3", 2)

    assert m =~
             "num_tokens_across_dp_cpu must be VllmBridge.Tensor.t() | [integer()], got \"5, 3\""

    assert {:error, %Error{type: :python_exception, python_type: "ValueError", message: m}} =
             FC._compute_sp_num_tokens([5, -3], 2)

    assert m =~ "num_tokens_across_dp_cpu entry must be >= 0, got -3"
  end

  test "_make_dp_metadata (called by name: it is not bound) and coordinate_batch_across_dp (DP off: no collective)" do
    dp2 = %VllmConfig{
      parallel_config: %ParallelConfig{data_parallel_size: 2, data_parallel_rank: 1}
    }

    counts = Tensor.from_list([3, 5], :int32)

    assert {:ok, %Vllm.ForwardContext.DPMetadata{num_tokens_across_dp_cpu: ^counts} = meta} =
             VllmBridge.call(@make_dp_metadata, [dp2, 5, counts, nil])

    assert Tensor.to_list(meta.max_tokens_across_dp_cpu) == 5

    assert {:ok, %Vllm.ForwardContext.DPMetadata{}} =
             VllmBridge.call(@make_dp_metadata, [dp2, 5, counts, nil], %{}, [])

    assert {:error, %Error{type: :python_exception, message: m}} =
             VllmBridge.call(@make_dp_metadata, [dp2, 4, counts, nil])

    assert m =~ "num_tokens_across_dp_cpu[1] is 5 but this rank's num_tokens is 4"

    pc = %ParallelConfig{}

    for extra <- [
          [],
          [nil],
          [nil, nil],
          [nil, nil, nil],
          [nil, nil, nil, 2],
          [nil, nil, nil, 2, []]
        ] do
      assert {:ok, {false, nil, mode}} =
               apply(FC, :coordinate_batch_across_dp, [7, false, true, pc | extra])

      assert mode == if(length(extra) >= 4, do: 2, else: 0)
    end

    assert {:ok, {false, nil, 1}} =
             FC.coordinate_batch_across_dp(7, false, true, pc, cudagraph_mode: 1)

    assert {:error, %Error{type: :python_exception, message: m}} =
             FC.coordinate_batch_across_dp(7, true, true, pc)

    assert m =~ "uniform_decode must be given"
  end

  test "u_batch_slices: the UBatchSlices alias, called" do
    slice = %UBatchSlice{request_slice: {0, 2}, token_slice: {0, 8}}
    assert FC.u_batch_slices() == {:ok, []}
    # [] in the last place is the options; a non-keyword list is the value.
    assert FC.u_batch_slices([]) == {:ok, []}

    assert FC.u_batch_slices([slice]) == {:ok, [slice]}

    assert {:ok, [%UBatchSlice{}]} = FC.u_batch_slices([slice], [])
    assert FC.u_batch_slices([], []) == {:ok, []}

    assert {:error, %Error{type: :bad_argument, message: m}} =
             FC.u_batch_slices(iterable: [slice])

    assert m =~ "iterable can only be given positionally"
    assert {:error, %Error{type: :bad_argument, message: m}} = FC.u_batch_slices([1, 2])
    assert m =~ "iterable must be [Vllm.Ubatch.UBatchSlice.t()], got [1, 2]"
  end
end
