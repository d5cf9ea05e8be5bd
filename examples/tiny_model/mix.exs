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
      releases: [tiny_model: [include_executables_for: [:unix]]],
      aliases: aliases()
    ]
  end

  # `mix py.bindings` regenerates the bindings of tiny_lm; `mix py.bindings --check` fails
  # when the committed ones are stale (make test-example runs it). One alias names every
  # module bound into lib/tiny_model/py: the task owns that folder.
  defp aliases do
    [
      "py.bindings":
        "vllm.gen.bindings --module tiny_lm --prefix TinyModel.Py --out lib/tiny_model/py " <>
          "--python-path priv/python"
    ]
  end

  def application do
    [extra_applications: [:logger], mod: {TinyModel.Application, []}]
  end
end
