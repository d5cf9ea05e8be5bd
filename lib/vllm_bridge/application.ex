defmodule VllmBridge.Application do
  @moduledoc false
  use Application

  @impl true
  def start(_type, _args) do
    # Codec: register the structs for Python dataclasses (VllmBridge.Codec.Registry), this
    # app's and those of the apps that depend on it (a user's generated bindings).
    VllmBridge.Codec.Registry.load_dependents()

    children = [
      VllmBridge.Pool.Directory,
      {Registry, keys: :unique, name: VllmBridge.Pool.Names},
      VllmBridge.Session.Manager,
      VllmBridge.Session.LooseRefs,
      {DynamicSupervisor, name: VllmBridge.PoolSupervisor, strategy: :one_for_one}
    ]

    with {:ok, sup} <-
           Supervisor.start_link(children, strategy: :one_for_one, name: VllmBridge.Supervisor) do
      start_configured_pools(sup)
    end
  end

  # `config :vllm_bridge, pools: [name: opts, ...]` (default: none).
  defp start_configured_pools(sup) do
    Application.get_env(:vllm_bridge, :pools, [])
    |> Enum.reduce_while({:ok, sup}, fn {name, opts}, ok ->
      case VllmBridge.Pool.start(name, opts) do
        {:ok, _} ->
          {:cont, ok}

        {:error, e} ->
          Supervisor.stop(sup)
          {:halt, {:error, {:pool_start_failed, name, Exception.message(e)}}}
      end
    end)
  end
end
