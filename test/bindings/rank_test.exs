Code.require_file("../support/bindings_helpers.exs", __DIR__)

defmodule VllmBridge.Bindings.RankTest do
  @moduledoc """
  `Vllm.Demo.Rank.Module`, the bindings of the demo's model runner (`vllm_bridge.demo.rank`),
  on a real worker without DP: every function, several arity forms, and bad arguments.
  (The demo test drives the same bindings with two DP ranks.)
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log
  @moduletag timeout: 180_000

  import VllmBridge.BindingsHelpers

  alias VllmBridge.{Error, Tensor}
  alias Vllm.Demo.Rank.Module, as: Runner

  setup_all do
    # Calls without `__runtime__` reach this pool too; one worker, so the runner (a global
    # of the worker process) is the same for calls with and without the session.
    start_default_pool!(modules: ["vllm_bridge.demo.rank"])
    s = session!()
    dir = Path.join(System.tmp_dir!(), "vb_rank_#{System.unique_integer([:positive])}")
    on_exit(fn -> File.rm_rf(dir) end)
    %{rt: [session_id: s.id, timeout_profile: :ml_inference], dir: dir}
  end

  test "default_capture_sizes: 1, 2, 4, then multiples of 8 up to 128", %{rt: rt} do
    sizes = List.to_tuple([1, 2, 4 | Enum.to_list(8..128//8)])
    assert Runner.default_capture_sizes() == {:ok, sizes}
    assert Runner.default_capture_sizes(__runtime__: rt) == {:ok, sizes}
  end

  test "save, create, load, step, read tokens and shut down", %{rt: rt, dir: dir} do
    path = Path.join(dir, "w.pt")
    model = %{"num_layers" => 1, "hidden_size" => 32, "num_experts" => 4, "vocab_size" => 64}

    assert {:ok, %{"path" => ^path, "seed" => 3, "sha256" => sha}} =
             Runner.save_weights(path, 3, model, __runtime__: rt)

    # The same seed gives the same bits; positional and named forms agree.
    assert {:ok, %{"sha256" => ^sha}} = Runner.save_weights(path, seed: 3, model: model)

    assert {:ok, %{"sha256" => other}} =
             Runner.save_weights(Path.join(dir, "w4.pt"), 4, model: model)

    assert other != sha

    assert {:ok, %{"data_parallel_size" => 1, "device" => device}} =
             Runner.create_runner(1, 0, __runtime__: rt)

    assert device == "cpu" or device =~ ~r/^cuda:\d+$/
    assert {:ok, %{"weights_sha256" => nil}} = Runner.runner_info(__runtime__: rt)
    assert {:ok, %{"sha256" => ^sha, "seed" => 3}} = Runner.load_model(path, __runtime__: rt)
    assert {:ok, %{"weights_sha256" => ^sha}} = Runner.runner_info(__runtime__: rt)

    assert {:ok, out} =
             Runner.execute_model(%{"a" => 3}, %{"a" => [5, 6, 7]}, [], __runtime__: rt)

    assert out["req_ids"] == ["a"]
    assert [token] = out["sampled_token_ids"]
    assert %Tensor{dtype: :float32, shape: [1, 64]} = out["logits"]
    assert Runner.request_tokens("a", __runtime__: rt) == {:ok, [5, 6, 7, token]}

    assert {:ok, %{"req_ids" => ["a"]}} = Runner.execute_model(%{"a" => 1}, __runtime__: rt)
    assert {:ok, [5, 6, 7, ^token, _]} = Runner.request_tokens("a")

    assert Runner.shutdown_runner(__runtime__: rt) == {:ok, true}
    assert Runner.shutdown_runner() == {:ok, false}

    assert {:error, %Error{type: :python_exception, message: m}} =
             Runner.runner_info(__runtime__: rt)

    assert m =~ "no runner in this worker: call vllm_bridge.demo.rank.create_runner first"
  end

  test "create_runner takes its options by name (with every default left as is)", %{rt: rt} do
    assert {:ok, info} = Runner.create_runner()
    assert info["data_parallel_size"] == 1 and info["enable_dbo"] == false

    assert {:ok, %{"enable_dbo" => true, "cudagraph_mode" => "PIECEWISE"}} =
             Runner.create_runner(enable_dbo: true, cudagraph_mode: "piecewise", __runtime__: rt)

    assert {:ok, true} = Runner.shutdown_runner(__runtime__: rt)
  end

  test "bad arguments are refused by name, in Elixir or in Python" do
    assert {:error, %Error{type: :bad_argument, message: m}} = Runner.load_model(5)
    assert m =~ "load_model/1: path must be String.t(), got 5"

    assert {:error, %Error{type: :bad_argument, message: m}} =
             Runner.execute_model(%{"a" => "three"})

    assert m =~ "num_scheduled_tokens must be %{optional(String.t()) => integer()}"

    assert {:error, %Error{type: :bad_argument, message: m}} =
             Runner.create_runner(max_num_reqs: "many")

    assert m =~ "max_num_reqs must be integer()"

    assert {:error, %Error{type: :python_exception, message: m}} = Runner.save_weights("")
    assert m =~ "path must be a non-empty str"
  end

  # The runner writes and reads files at paths its caller names: it is not on the default
  # allow-list, so only a pool that allows it (`modules:`, as this module's and the demo's
  # do) reaches it.
  test "a pool with default options refuses the runner by name and writes no file", %{dir: dir} do
    pool = :rank_default_allow
    {:ok, _} = VllmBridge.start_pool(pool, size: 1)
    on_exit(fn -> VllmBridge.stop_pool(pool) end)
    :ok = VllmBridge.Pool.await_ready(pool, 60_000)
    rt = [pool_name: pool]
    path = Path.join([dir, "default", "new", "w.pt"])

    for call <- [
          fn -> Runner.save_weights(path, 0, __runtime__: rt) end,
          fn -> Runner.load_model(path, __runtime__: rt) end
        ] do
      assert {:error, %Error{type: :bad_argument, message: m}} = call.()
      assert m =~ "module 'vllm_bridge.demo.rank' is not in the worker's allow-list"
      refute File.exists?(Path.join(dir, "default"))
    end
  end
end
