defmodule VllmBridge.Bindings.StalenessTest do
  @moduledoc """
  The committed bindings (`priv/bindings/*.json`, `lib/vllm/**`, `demo/lib/vllm/**`) are exactly what
  `mix vllm.gen.bindings` would write now, reading the Python modules through a worker.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  alias VllmBridge.Bindings.Generator
  alias VllmBridge.Bindings.Gen.Files

  @root File.cwd!()

  setup_all do
    {:ok, manifests} = Generator.fetch()
    %{manifests: manifests, files: Generator.render(manifests)}
  end

  defp stale_message({changed, stale}) do
    "the generated bindings are stale (differ: #{inspect(changed)}, no longer generated: " <>
      "#{inspect(stale)}); run `mix vllm.gen.bindings` and commit the result"
  end

  test "the committed manifests and code are what the generator writes now", %{files: files} do
    diff = Generator.diff(files, @root)
    assert diff == {[], []}, stale_message(diff)
  end

  test "the code re-rendered from the committed manifests is the committed code" do
    files = Generator.render(Generator.read_manifests(@root))
    diff = Generator.diff(files, @root)
    assert diff == {[], []}, stale_message(diff)
  end

  test "one file per generated module, each with the header and a manifest per module", %{
    files: files,
    manifests: manifests
  } do
    code = for {path, text} <- files, String.ends_with?(path, ".ex"), do: {path, text}

    assert Enum.all?(code, fn {path, text} ->
             (String.starts_with?(path, "lib/vllm/") or
                String.starts_with?(path, "demo/lib/vllm/")) and
               String.starts_with?(text, Files.marker())
           end)

    assert Enum.sort(for {name, _} <- Generator.modules(), do: "priv/bindings/#{name}.json") ==
             files |> Map.keys() |> Enum.filter(&String.ends_with?(&1, ".json")) |> Enum.sort()

    assert Enum.map(manifests, & &1["module"]) == Enum.map(Generator.modules(), &elem(&1, 0))
    # Formatted as `mix format` would.
    for {path, text} <- code,
        do: assert(IO.iodata_to_binary(Code.format_string!(text)) <> "\n" == text, path)
  end

  test "mix vllm.gen.bindings --check passes on the committed files (live and from the manifests)" do
    Mix.shell(Mix.Shell.Process)
    on_exit(fn -> Mix.shell(Mix.Shell.IO) end)

    # Every committed manifest and generated module counts.
    committed =
      length(
        Path.wildcard("priv/bindings/*.json") ++
          Path.wildcard("lib/vllm/**/*.ex") ++ Path.wildcard("demo/lib/vllm/**/*.ex")
      )

    up_to_date = "bindings are up to date (#{committed} files)"

    for argv <- [["--check"], ["--check", "--from-manifests"]] do
      Mix.Task.rerun("vllm.gen.bindings", argv)
      assert_received {:mix_shell, :info, [^up_to_date]}
    end

    assert_raise Mix.Error, ~r"unknown option --chek", fn ->
      Mix.Task.rerun("vllm.gen.bindings", ["--chek"])
    end
  end

  test "a changed, a missing and a stale file are all reported, and write/2 repairs them", %{
    files: files
  } do
    root = Path.join(System.tmp_dir!(), "vllm_bindings_#{System.unique_integer([:positive])}")
    on_exit(fn -> File.rm_rf!(root) end)

    assert length(Generator.write(files, root)) == map_size(files)
    assert Generator.diff(files, root) == {[], []}

    edited = "lib/vllm/forward_context/module.ex"
    File.write!(Path.join(root, edited), "# edited by hand\n", [:append])
    File.rm!(Path.join(root, "priv/bindings/vllm_bridge.dp.json"))
    stale = "lib/vllm/old/thing.ex"
    demo_stale = "demo/lib/vllm/old_demo/module.ex"

    for path <- [stale, demo_stale] do
      File.mkdir_p!(Path.dirname(Path.join(root, path)))
      File.write!(Path.join(root, path), Files.marker() <> " from somewhere\n")
    end

    # A demo binding (rooted in demo/lib/, whichever demo module it is).
    demo_edited = files |> Map.keys() |> Enum.sort() |> Enum.find(&(&1 =~ ~r"^demo/lib/vllm/"))
    File.write!(Path.join(root, demo_edited), "# edited by hand\n", [:append])
    hand_written = "lib/vllm/hand.ex"
    File.write!(Path.join(root, hand_written), "defmodule Hand do\nend\n")

    assert Generator.diff(files, root) ==
             {Enum.sort([edited, demo_edited, "priv/bindings/vllm_bridge.dp.json"]),
              Enum.sort([demo_stale, stale])}

    Generator.write(files, root)
    assert Generator.diff(files, root) == {[], []}
    refute File.exists?(Path.join(root, stale))
    refute File.exists?(Path.join(root, demo_stale))
    assert File.exists?(Path.join(root, hand_written))
  end
end
