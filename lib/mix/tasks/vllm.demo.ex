defmodule Mix.Tasks.Vllm.Demo do
  @shortdoc "Runs the vllm_bridge demo against real Python workers"
  @moduledoc """
  The main job of the README: `make demo` runs `mix vllm.demo`.

  Starts a pool of one Python worker, prints its handshake and the result of one call
  made through the public API (`VllmBridge.call/4`), then stops the pool.
  """
  use Mix.Task

  @impl true
  @doc false
  def run(_argv) do
    Mix.Task.run("app.start")
    IO.puts("starting a pool of one Python worker (python -m vllm_bridge.worker) ...")
    {:ok, _} = VllmBridge.start_pool(:demo, size: 1)
    {:ok, [%{pid: worker}]} = VllmBridge.Pool.workers(:demo)
    hello = VllmBridge.Worker.hello(worker)

    IO.puts(
      "handshake: protocol #{hello["protocol"]}, os pid #{hello["pid"]}, " <>
        "python #{hello["python"]}, torch #{hello["torch"]}, device #{hello["device"]}, " <>
        "instance #{hello["instance"]}, capabilities #{Enum.join(hello["capabilities"] || [], ",")}"
    )

    {:ok, sum} = VllmBridge.call({"vllm_bridge.diag", "add"}, [40, 2], %{}, pool_name: :demo)
    IO.puts("vllm_bridge.diag.add(40, 2) = #{sum}")
    :ok = VllmBridge.stop_pool(:demo)
  end
end
