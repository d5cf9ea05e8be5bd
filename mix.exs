defmodule VllmBridge.MixProject do
  use Mix.Project

  def project do
    [
      app: :vllm_bridge,
      version: "0.1.0",
      elixir: "~> 1.14",
      start_permanent: Mix.env() == :prod,
      elixirc_options: [warnings_as_errors: true],
      deps: []
    ]
  end

  def application do
    [
      extra_applications: [:logger],
      mod: {VllmBridge.Application, []}
    ]
  end
end
