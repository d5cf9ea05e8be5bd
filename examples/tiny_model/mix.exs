defmodule TinyModel.MixProject do
  use Mix.Project

  def project do
    [
      app: :tiny_model,
      version: "0.1.0",
      elixir: "~> 1.14",
      start_permanent: Mix.env() == :prod,
      elixirc_options: [warnings_as_errors: true],
      deps: [{:vllm_bridge, path: "../.."}],
      releases: [tiny_model: [include_executables_for: [:unix]]]
    ]
  end

  def application do
    [extra_applications: [:logger], mod: {TinyModel.Application, []}]
  end
end
