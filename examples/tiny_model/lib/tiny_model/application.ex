defmodule TinyModel.Application do
  @moduledoc false
  use Application

  @impl true
  def start(_type, _args) do
    # The pools are the library's (config/runtime.exs), started with it; so is the
    # registration of the structs generated into TinyModel.Py.TinyLm.* (this app depends
    # on :vllm_bridge), which makes tiny_lm's dataclasses come back as those structs.
    Supervisor.start_link([], strategy: :one_for_one, name: TinyModel.Supervisor)
  end
end
