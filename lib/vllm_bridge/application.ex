defmodule VllmBridge.Application do
  @moduledoc false
  use Application

  @impl true
  def start(_type, _args) do
    # Codec: register the structs for Python dataclasses (VllmBridge.Codec.Registry), this
    # app's and those of the apps that depend on it (a user's generated bindings).
    VllmBridge.Codec.Registry.load_dependents()

    children = [
      VllmBridge.Shm,
      VllmBridge.Pool.Directory,
      {Registry, keys: :unique, name: VllmBridge.Pool.Names},
      VllmBridge.Session.Manager,
      VllmBridge.Session.LooseRefs,
      # The :pg scope where each pool's queue joins the group {:pool, name}: how a pool
      # started on another node of the cluster is found by its name (VllmBridge.Remote).
      %{id: VllmBridge.Pool.Groups, start: {:pg, :start_link, [VllmBridge.Pool.Groups]}},
      {DynamicSupervisor, name: VllmBridge.PoolSupervisor, strategy: :one_for_one}
    ]

    with {:ok, sup} <-
           Supervisor.start_link(children, strategy: :one_for_one, name: VllmBridge.Supervisor) do
      start_configured_pools(sup)
    end
  end

  # `config :vllm_bridge, pools: [name: opts, ...]` (default: none). A pool that does not
  # start stops the application: what Mix or the release prints then is the reason, with
  # the Python traceback when there is one (an on_start that raised).
  defp start_configured_pools(sup) do
    case Application.get_env(:vllm_bridge, :pools, []) do
      pools when is_list(pools) ->
        Enum.reduce_while(pools, {:ok, sup}, fn
          {name, opts}, ok ->
            case VllmBridge.Pool.start(name, opts) do
              {:ok, _} ->
                {:cont, ok}

              {:error, e} ->
                Supervisor.stop(sup)
                {:halt, {:error, {:pool_start_failed, name, describe(e)}}}
            end

          other, _ok ->
            Supervisor.stop(sup)
            {:halt, {:error, {:bad_pools_config, bad_pools(other)}}}
        end)

      other ->
        Supervisor.stop(sup)
        {:error, {:bad_pools_config, bad_pools(other)}}
    end
  end

  defp bad_pools(other) do
    "config :vllm_bridge, pools: must be a keyword list of pool name => options, " <>
      "got #{inspect(other, limit: 8)}"
  end

  defp describe(%VllmBridge.Error{traceback: tb} = e) when is_binary(tb) and tb != "",
    do: Exception.message(e) <> "\n" <> tb

  defp describe(e), do: Exception.message(e)
end
