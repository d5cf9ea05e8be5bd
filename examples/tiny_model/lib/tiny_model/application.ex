defmodule TinyModel.Application do
  @moduledoc false
  use Application

  @impl true
  def start(_type, _args) do
    # The structs of tiny_lm's dataclasses (generated into TinyModel.Py.TinyLm.*) decode
    # as such once registered; the library registers only its own modules.
    VllmBridge.Codec.Registry.load(:tiny_model)
    # The pools themselves are the library's (config/runtime.exs), started with it.
    Supervisor.start_link([], strategy: :one_for_one, name: TinyModel.Supervisor)
  end
end
