Code.require_file("../support/bindings_helpers.exs", __DIR__)

defmodule VllmBridge.Bindings.UbatchTest do
  @moduledoc """
  `Vllm.Ubatch.Module` and the struct `Vllm.Ubatch.UBatchSlice` (with its method and
  properties bound) on a real worker. Slices are sent as `{start, stop}` pairs and come
  back as references to Python slices.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.BindingsHelpers

  alias Vllm.Config.ParallelConfig
  alias Vllm.Ubatch.Module, as: UB
  alias Vllm.Ubatch.UBatchSlice
  alias VllmBridge.{Error, Tensor}

  setup_all do
    start_default_pool!()
    :ok
  end

  test "the bindings and their arities" do
    assert exported(UB) == %{
             check_ubatch_thresholds: 3..4,
             is_last_ubatch_empty: 3..4,
             maybe_create_ubatch_slices: 4..7,
             pad_out_ubatch_slices: 3..4,
             u_batch_slices: 0..2
           }

    assert exported(UBatchSlice) == %{is_empty: 1..2, num_reqs: 1..2, num_tokens: 1..2}
  end

  test "is_last_ubatch_empty and check_ubatch_thresholds" do
    assert UB.is_last_ubatch_empty(4, 8, 2) == {:ok, true}
    assert UB.is_last_ubatch_empty(5, 8, 2, []) == {:ok, false}
    on = %ParallelConfig{enable_dbo: true, dbo_decode_token_threshold: 4}
    assert UB.check_ubatch_thresholds(on, 4, true) == {:ok, true}
    assert UB.check_ubatch_thresholds(on, 4, false) == {:ok, false}
    assert UB.check_ubatch_thresholds(%ParallelConfig{}, 4096, false, []) == {:ok, false}

    assert {:error, %Error{type: :bad_argument, message: m}} =
             UB.check_ubatch_thresholds(on, 4, "yes")

    assert m =~ ~s|uniform_decode must be boolean(), got "yes"|
  end

  test "maybe_create_ubatch_slices: every arity, and the slices' methods" do
    assert UB.maybe_create_ubatch_slices(false, [2, 2], 4, 2) == {:ok, {nil, nil}}

    for extra <- [[], [2], [2, 3], [2, 3, []], [[split_point: 3]]] do
      assert {:ok, {[a, b], [_, padded]}} =
               apply(UB, :maybe_create_ubatch_slices, [true, [2, 2, 1], 6, 4 | extra])

      # Slices travel by value, as {start, stop} pairs.
      assert %UBatchSlice{request_slice: {0, 2}, token_slice: {0, 3}} = a
      assert %UBatchSlice{request_slice: {1, 3}, token_slice: {3, 5}} = b
      assert UBatchSlice.num_tokens(a) == {:ok, 3}
      assert UBatchSlice.num_tokens(b, []) == {:ok, 2}
      assert UBatchSlice.num_reqs(a) == {:ok, 2}
      assert UBatchSlice.num_reqs(padded, __runtime__: []) == {:ok, 3}
      assert UBatchSlice.is_empty(b) == {:ok, false}
    end

    counts = Tensor.from_list([2, 2, 1], :int64)
    assert {:ok, {[_, _], [_, _]}} = UB.maybe_create_ubatch_slices(true, counts, 6, 4)

    assert {:error, %Error{type: :python_exception, message: m}} =
             UB.maybe_create_ubatch_slices(true, [1, 1], 2, 2, 2, 2)

    assert m =~ "a micro-batch would be empty"
  end

  test "structs built in Elixir: pairs for the slices" do
    empty = %UBatchSlice{request_slice: {1, 1}, token_slice: {4, 8}}
    full = %UBatchSlice{request_slice: {0, 2}, token_slice: {0, 4}}
    assert UBatchSlice.is_empty(empty) == {:ok, true}
    assert UBatchSlice.is_empty(full, []) == {:ok, false}
    assert UBatchSlice.num_tokens(empty) == {:ok, 4}

    second = %UBatchSlice{request_slice: {2, 3}, token_slice: {4, 6}}
    assert {:ok, [first, padded]} = UB.pad_out_ubatch_slices([full, second], 8, 4)
    assert UBatchSlice.num_tokens(first) == {:ok, 4}

    assert UBatchSlice.num_tokens(padded) == {:ok, 4}
    assert UBatchSlice.num_reqs(padded) == {:ok, 2}
    assert {:ok, [_]} = UB.pad_out_ubatch_slices([full], 4, 2, [])

    assert {:error, %Error{type: :bad_argument, message: m}} =
             UBatchSlice.is_empty(%UBatchSlice{request_slice: {0, -1}, token_slice: {0, 1}})

    assert m =~ "UBatchSlice.request_slice.stop must be >= 0"

    assert {:error, %Error{type: :bad_argument, message: m}} =
             UBatchSlice.num_tokens(%UBatchSlice{request_slice: "0:1", token_slice: {0, 1}})

    assert m =~ "UBatchSlice.request_slice must be a slice"
  end

  test "u_batch_slices: the alias in its own module" do
    s = %UBatchSlice{request_slice: {0, 1}, token_slice: {0, 2}}
    assert UB.u_batch_slices() == {:ok, []}
    assert {:ok, [%UBatchSlice{}]} = UB.u_batch_slices([s])
    assert UB.u_batch_slices([], __runtime__: [timeout: 5_000]) == {:ok, []}
  end
end
