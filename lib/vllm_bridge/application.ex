defmodule VllmBridge.Application do
  @moduledoc false
  use Application

  @impl true
  def start(_type, _args) do
    # Codec: register the app's structs for Python dataclasses (VllmBridge.Codec.Registry).
    VllmBridge.Codec.Registry.load(:vllm_bridge)

    children = []
    Supervisor.start_link(children, strategy: :one_for_one, name: VllmBridge.Supervisor)
  end
end
