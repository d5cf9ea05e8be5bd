defmodule VllmBridge.MixProject do
  use Mix.Project

  def project do
    [
      app: :vllm_bridge,
      version: "0.1.0",
      elixir: "~> 1.14",
      start_permanent: Mix.env() == :prod,
      elixirc_options: [warnings_as_errors: true],
      elixirc_paths: elixirc_paths(Mix.env()),
      deps: []
    ]
  end

  # The benchmarks and the demo (with the demo's generated bindings) are compiled only in
  # dev and test: a user's build (prod) holds the bridge and the Vllm bindings alone.
  defp elixirc_paths(:prod), do: ["lib"]
  defp elixirc_paths(_), do: ["lib", "bench/lib", "demo/lib"]

  def application do
    [
      extra_applications: [:logger],
      mod: {VllmBridge.Application, []}
    ]
  end
end
