defmodule TinyModelTest do
  @moduledoc """
  The example app against real workers: the pools of config/runtime.exs, whose workers
  ran `tiny_lm.setup` (on_start), the model's forward under `set_forward_context` on one
  rank and on a DP pair, and bad input.
  """
  use ExUnit.Case, async: false

  alias TinyModel.Py.TinyLm.{ContextSeen, ForwardOutput, ModelInfo}
  alias TinyModel.Py.TinyLm.Module, as: TinyLm
  alias Vllm.ForwardContext.BatchDescriptor
  alias VllmBridge.{Error, Pool, Tensor}

  @seed Application.compile_env(:tiny_model, :seed, 7)

  setup_all do
    {:ok, dp} = TinyModel.DP.open()
    on_exit(fn -> TinyModel.DP.close(dp) end)
    %{dp: dp}
  end

  test "every worker of both pools ran setup once, with the same seed and weights" do
    {:ok, [single]} = TinyModel.model_infos(:tiny)
    {:ok, [rank0, rank1] = pair} = TinyModel.model_infos(:tiny_dp)

    assert %ModelInfo{seed: @seed, dp_rank: nil, setup_calls: 1} = single
    assert %ModelInfo{dp_rank: 0, setup_calls: 1} = rank0
    assert %ModelInfo{dp_rank: 1, setup_calls: 1} = rank1
    assert length(Enum.uniq_by([single | pair], & &1.os_pid)) == 3
    assert Enum.uniq_by([single | pair], &{&1.checksum, &1.num_parameters}) |> length() == 1
  end

  test "the forward reads the context it runs under" do
    {:ok, out} =
      TinyModel.forward([1, 2, 3],
        attn_metadata: %{"layers.1" => %{"scale" => 0.5}},
        batch_descriptor: %BatchDescriptor{num_tokens: 8},
        cudagraph_runtime_mode: :piecewise
      )

    assert %ForwardOutput{logits: %Tensor{dtype: :float32, shape: [3, 64]}} = out

    assert out.context == %ContextSeen{
             num_tokens: 3,
             padded_tokens: 8,
             num_tokens_across_dp: nil,
             batch_descriptor_tokens: 8,
             cudagraph_mode: "PIECEWISE",
             virtual_engine: 0,
             scaled_layers: ["layers.1"]
           }

    # The layer scale changed the result; padding alone does not.
    {:ok, plain} = TinyModel.forward([1, 2, 3])

    {:ok, padded} =
      TinyModel.forward([1, 2, 3], batch_descriptor: %BatchDescriptor{num_tokens: 8})

    refute close?(plain.logits, out.logits)
    assert close?(plain.logits, padded.logits)
    assert plain.context.padded_tokens == 3
  end

  test "the forward needs a forward context" do
    assert {:error, %Error{type: :python_exception, python_type: "RuntimeError"} = e} =
             TinyLm.forward([1, 2], __runtime__: [pool_name: :tiny])

    assert e.message =~ "forward context"
  end

  test "the DP pair agrees on its counts, pads to the largest, and matches one rank", %{dp: dp} do
    for {tokens_by_rank, seed} <- [{[[1, 2, 3], [4, 5]], 1}, {[[9], [8, 7, 6, 5, 4]], 2}] do
      {:ok, outs} = TinyModel.DP.forward(dp, tokens_by_rank)
      counts = Enum.map(tokens_by_rank, &length/1)

      for {out, tokens} <- Enum.zip(outs, tokens_by_rank) do
        assert out.context.num_tokens == length(tokens)
        assert out.context.num_tokens_across_dp == counts
        assert out.context.padded_tokens == Enum.max(counts)
      end

      {:ok, single} = TinyModel.forward(Enum.concat(tokens_by_rank))
      assert single.context.num_tokens_across_dp == nil, "seed #{seed}"
      assert Enum.flat_map(outs, & &1.next_tokens) == single.next_tokens

      assert close?(
               Enum.flat_map(outs, &Tensor.to_list(&1.logits)),
               Tensor.to_list(single.logits)
             )
    end
  end

  test "a bad token is a clear Python error, and both pools keep serving", %{dp: dp} do
    assert {:error, %Error{type: :python_exception, python_type: "ValueError"} = e} =
             TinyModel.forward([1, 999])

    assert e.message =~ "token_ids[1]"
    assert e.message =~ "999"
    assert {:ok, %ForwardOutput{next_tokens: [_]}} = TinyModel.forward([1])

    # On the DP pair, rank 1's step fails after both entered the context; rank 0's
    # succeeds, and the pair runs the next step together.
    assert {:error, %Error{python_type: "ValueError", message: message}} =
             TinyModel.DP.forward(dp, [[1, 2], [3, -4]])

    assert message =~ "-4"
    assert {:ok, [_, _]} = TinyModel.DP.forward(dp, [[1, 2], [3, 4]])
  end

  test "a value of the wrong type is refused in Elixir, naming it" do
    assert {:error, %Error{type: :bad_argument, message: message}} = TinyModel.forward([1, :two])
    assert message =~ "token_ids"
  end

  test "a restarted worker runs setup again before it takes a call" do
    {:ok, [before]} = TinyModel.model_infos(:tiny)
    {_, 0} = System.cmd("kill", ["-9", Integer.to_string(before.os_pid)])
    after_restart = await_new_worker(:tiny, before.os_pid)

    assert %ModelInfo{setup_calls: 1, checksum: checksum} = after_restart
    assert after_restart.os_pid != before.os_pid
    assert checksum == before.checksum
    assert {:ok, %ForwardOutput{}} = TinyModel.forward([1, 2, 3])
  end

  # Asks until the pool's worker is a new process (its restart takes a torch import).
  defp await_new_worker(pool, old_pid) do
    with {:ok, [%{os_pid: pid}]} when pid != old_pid <- Pool.workers(pool),
         {:ok, [info]} <- TinyModel.model_infos(pool) do
      info
    else
      _ ->
        Process.sleep(100)
        await_new_worker(pool, old_pid)
    end
  end

  defp close?(%Tensor{} = a, %Tensor{} = b), do: close?(Tensor.to_list(a), Tensor.to_list(b))

  defp close?(a, b) when is_list(a) and is_list(b) do
    a = List.flatten(a)
    b = List.flatten(b)
    length(a) == length(b) and Enum.all?(Enum.zip(a, b), fn {x, y} -> abs(x - y) <= 1.0e-4 end)
  end
end
