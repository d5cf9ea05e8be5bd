defmodule TinyModel.ReleaseTest do
  @moduledoc """
  The app survives `mix release`: a prod release built in a folder of its own boots with
  the configured pools (config/runtime.exs: the `{module, function, args}` worker_env, the
  `{app, path}` python_path, the on_start), finds tiny_lm.py in the release's own priv,
  and runs the model on the DP pair and on one rank (`TinyModel.Release.smoke/0`).
  Excluded with `mix test --exclude release`.
  """
  use ExUnit.Case, async: false

  @moduletag :release
  @moduletag timeout: 600_000

  test "a prod release boots its configured pools and runs the model" do
    root =
      Path.join(System.tmp_dir!(), "tiny_model_release_#{System.unique_integer([:positive])}")

    on_exit(fn -> File.rm_rf!(root) end)
    release = Path.join(root, "rel")

    {out, status} =
      System.cmd("mix", ["release", "--overwrite", "--path", release],
        env: [{"MIX_ENV", "prod"}, {"MIX_BUILD_PATH", Path.join(root, "build")}],
        stderr_to_stdout: true
      )

    assert status == 0, out
    [app_dir] = Path.wildcard(Path.join(release, "lib/tiny_model-*"))
    assert File.regular?(Path.join(app_dir, "priv/python/tiny_lm.py"))

    # The release is run from elsewhere, with the interpreter from its host's environment.
    {out, status} =
      System.cmd(Path.join(release, "bin/tiny_model"), ["eval", "TinyModel.Release.smoke()"],
        env: [{"VLLM_BRIDGE_PYTHON", python!()}],
        cd: root,
        stderr_to_stdout: true
      )

    assert status == 0, out
    assert out =~ "workers: rank 0 seed 7, rank 1 seed 7"
    assert out =~ "python_path: #{app_dir}/priv/python"
    assert out =~ "dp rank 0: next_tokens "
    assert out =~ ~r/dp rank 1: next_tokens \[\d+, \d+\], padded to 3, across dp \[3, 2\]/
    assert out =~ "agree: true"
  end

  defp python! do
    System.get_env("VLLM_BRIDGE_PYTHON") ||
      Application.get_env(:vllm_bridge, :python) ||
      flunk("set VLLM_BRIDGE_PYTHON to the interpreter of the workers")
  end
end
