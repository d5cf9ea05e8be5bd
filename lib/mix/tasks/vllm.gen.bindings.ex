defmodule Mix.Tasks.Vllm.Gen.Bindings do
  @shortdoc "Regenerates the Elixir bindings (lib/vllm/, demo/lib/vllm/) from the Python modules"
  @moduledoc """
  Regenerates the generated bindings: reads the Python modules through a worker
  (`vllm_bridge.bridge.introspect`), writes the manifests `priv/bindings/*.json` and the
  Elixir modules under `lib/vllm/` (the demo's under `demo/lib/vllm/`), and deletes
  generated files that are no longer produced.

  **What is bound of a module is what it exports**: the names of its `__all__` (a module
  without `__all__`: the public names it defines itself, not those it imports), plus, for
  `vllm_bridge.forward_context`, the names vLLM's own bindings have beyond its exports
  (`_compute_sp_num_tokens`, `_compute_chunked_local_num_tokens`, `_forward_context`,
  `logger`; seeds/elixir_bindings_forward_context.txt). Private helpers and imported names
  a module does not export are not bound. The modules bound: `vllm_bridge.forward_context`,
  `.config`, `.cudagraph`, `.ubatch`, `.dp`, and the demo's `vllm_bridge.demo.rank`.

      mix vllm.gen.bindings                  # regenerate (needs the Python venv)
      mix vllm.gen.bindings --check          # fail when the committed files are stale
      mix vllm.gen.bindings --from-manifests # re-render the code from priv/bindings/ only

  The app is compiled (generated modules included) before the task runs: if a generated
  file does not compile any more, delete `lib/vllm/` (or `demo/lib/vllm/`) and run the task
  again.
  """
  use Mix.Task

  alias VllmBridge.Bindings.Generator

  @switches [check: :boolean, from_manifests: :boolean]

  @impl true
  @doc false
  def run(argv) do
    {opts, rest} = OptionParser.parse!(argv, strict: @switches)
    if rest != [], do: Mix.raise("unexpected arguments: #{Enum.join(rest, " ")}")
    root = File.cwd!()
    Mix.Task.run("app.start")

    manifests =
      if opts[:from_manifests] do
        Generator.read_manifests(root)
      else
        case Generator.fetch() do
          {:ok, manifests} -> manifests
          {:error, e} -> Mix.raise("reading the Python modules failed: #{Exception.message(e)}")
        end
      end

    files = Generator.render(manifests)

    if opts[:check] do
      case Generator.diff(files, root) do
        {[], []} ->
          Mix.shell().info("bindings are up to date (#{map_size(files)} files)")

        {changed, stale} ->
          Mix.raise(
            "the generated bindings are stale: " <>
              Enum.join(
                Enum.map(changed, &"#{&1} (differs)") ++ Enum.map(stale, &"#{&1} (stale)"),
                ", "
              ) <>
              "; run `mix vllm.gen.bindings`"
          )
      end
    else
      {_, stale} = diff = Generator.diff(files, root)
      written = Generator.write(files, root, diff)
      Enum.each(written, &Mix.shell().info("wrote #{&1}"))
      Enum.each(stale, &Mix.shell().info("deleted #{&1}"))

      Mix.shell().info(
        "#{length(written)} written, #{length(stale)} deleted, #{map_size(files)} generated"
      )
    end
  end
end
