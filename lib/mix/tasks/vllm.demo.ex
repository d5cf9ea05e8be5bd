defmodule Mix.Tasks.Vllm.Demo do
  @shortdoc "Runs the vllm_bridge demo against real Python workers"
  @moduledoc """
  The main job of the README: `make demo` runs `mix vllm.demo`.

  For now it starts one Python worker, prints its handshake and the result of one call.
  """
  use Mix.Task

  @impl true
  @doc false
  def run(_argv) do
    Mix.Task.run("app.start")
    IO.puts("starting a Python worker (python -m vllm_bridge.worker) ...")
    {:ok, worker} = VllmBridge.Worker.start_link()
    hello = VllmBridge.Worker.hello(worker)

    IO.puts(
      "handshake: protocol #{hello["protocol"]}, os pid #{hello["pid"]}, " <>
        "python #{hello["python"]}, torch #{hello["torch"]}, device #{hello["device"]}"
    )

    {:ok, sum} = VllmBridge.Worker.call(worker, "vllm_bridge.diag", "add", [40, 2])
    IO.puts("vllm_bridge.diag.add(40, 2) = #{sum}")
    :ok = VllmBridge.Worker.close(worker)
  end
end
