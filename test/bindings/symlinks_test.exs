Code.require_file("../support/bindings_helpers.exs", __DIR__)

defmodule VllmBridge.Bindings.SymlinksTest do
  @moduledoc """
  `mix vllm.gen.bindings` follows no symbolic link out of the project: a folder or file
  under `--out` that links outside, an `--out` that is such a link or lies below one. In
  each case a marker file (a file that starts with the generator's marker line, so a stale
  one would be deleted) and the rest of the outside folder stay as they were, and nothing
  is written there. Links that stay inside the project keep working, for a user's run and
  for the library's own (`Generator.diff/3`, `write/3`).
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log
  @moduletag timeout: 300_000

  import VllmBridge.BindingsHelpers, only: [gen_task!: 2, gen_task_error: 2]

  alias VllmBridge.Bindings.Generator
  alias VllmBridge.Bindings.Gen.Files

  @user_dir Path.expand("../support/user_python", __DIR__)
  @run ~w(--module my_model --prefix MyApp.Py --python-path) ++ [@user_dir]
  @marker Files.marker() <> " from the Python module old.\n"

  setup do
    n = System.unique_integer([:positive])
    project = Path.join(System.tmp_dir!(), "vb_links_app_#{n}")
    outside = Path.join(System.tmp_dir!(), "vb_links_outside_#{n}")
    File.mkdir_p!(Path.join(project, "lib"))
    File.mkdir_p!(Path.join(outside, "sub"))
    File.write!(Path.join(outside, "sub/precious.ex"), @marker)
    File.write!(Path.join(outside, "precious.ex"), @marker)

    on_exit(fn ->
      File.rm_rf!(project)
      File.rm_rf!(outside)
    end)

    %{project: project, outside: outside, before: snapshot(outside)}
  end

  # Every entry under `dir` (links not followed) with its content or link target.
  defp snapshot(dir) do
    dir
    |> Path.join("**")
    |> Path.wildcard(match_dot: true)
    |> Enum.map(fn path ->
      content =
        case File.lstat!(path).type do
          :regular -> File.read!(path)
          :symlink -> {:link, File.read_link!(path)}
          type -> type
        end

      {Path.relative_to(path, dir), content}
    end)
    |> Enum.sort()
  end

  defp link!(target, project, path) do
    File.mkdir_p!(Path.dirname(Path.join(project, path)))
    :ok = File.ln_s(target, Path.join(project, path))
  end

  test "a linked folder and a linked marker file under --out are neither followed nor deleted",
       %{project: project, outside: outside, before: before} do
    link!(outside, project, "lib/my_app/py/link")
    link!(Path.join(outside, "precious.ex"), project, "lib/my_app/py/old.ex")
    # A dangling link, and a real stale file beside them, which does go.
    link!(Path.join(outside, "gone.ex"), project, "lib/my_app/py/dangling.ex")
    File.write!(Path.join(project, "lib/my_app/py/stale.ex"), @marker)

    lines = gen_task!(project, @run ++ ~w(--out lib/my_app/py))

    assert "deleted lib/my_app/py/stale.ex" in lines
    refute Enum.any?(lines, &(&1 =~ ~r/link|old\.ex|dangling/)), inspect(lines)
    assert List.last(lines) == "4 written, 1 deleted, 4 generated"
    assert snapshot(outside) == before
    # The links themselves are left as they were.
    assert File.read_link!(Path.join(project, "lib/my_app/py/link")) == outside
    assert {:ok, _} = File.read_link(Path.join(project, "lib/my_app/py/dangling.ex"))
    assert File.regular?(Path.join(project, "lib/my_app/py/my_model/module.ex"))
    assert List.last(gen_task!(project, @run ++ ~w(--out lib/my_app/py --check))) =~ "up to date"
  end

  test "a generated file is not written through a linked folder or a linked file",
       %{project: project, outside: outside, before: before} do
    # The folder of my_model's files links outside.
    link!(outside, project, "lib/a/py/my_model")

    for extra <- [[], ["--check"]] do
      message = gen_task_error(project, @run ++ ~w(--out lib/a/py) ++ extra)
      assert message =~ "lib/a/py/my_model/module.ex", message
      assert message =~ "outside the project", message
    end

    assert snapshot(outside) == before
    refute File.exists?(Path.join(project, "lib/a/py/my_model.ex"))

    # A generated file's own path is a link (to a file outside).
    link!(Path.join(outside, "precious.ex"), project, "lib/b/py/my_model/kind.ex")
    message = gen_task_error(project, @run ++ ~w(--out lib/b/py))
    assert message =~ "lib/b/py/my_model/kind.ex is a symbolic link", message
    assert snapshot(outside) == before
    assert File.ls!(Path.join(project, "lib/b/py/my_model")) == ["kind.ex"]
  end

  test "an --out that is a link outside, or lies below one, is refused naming it",
       %{project: project, outside: outside, before: before} do
    link!(outside, project, "lib/out_link")
    link!(outside, project, "lib/parent")

    for out <- ~w(lib/out_link lib/out_link/sub lib/parent/py) do
      message = gen_task_error(project, @run ++ ["--out", out])
      assert message =~ ~s(--out "#{out}" leads outside the project), message
      assert message =~ outside, message
    end

    # A link to the project root itself would make the whole project the task's folder.
    link!("..", project, "lib/root_link")
    message = gen_task_error(project, @run ++ ~w(--out lib/root_link))
    assert message =~ ~s(--out "lib/root_link" must be a folder inside the project), message

    link!("loop", project, "lib/loop")
    message = gen_task_error(project, @run ++ ~w(--out lib/loop/py))
    assert message =~ ~s(--out "lib/loop/py": a loop of symbolic links), message
    assert snapshot(outside) == before
  end

  test "an --out that links to a folder inside the project works", %{project: project} do
    File.mkdir_p!(Path.join(project, "lib/real_py"))
    File.write!(Path.join(project, "lib/real_py/stale.ex"), @marker)
    link!("real_py", project, "lib/py_link")

    lines = gen_task!(project, @run ++ ~w(--out lib/py_link))
    assert "deleted lib/py_link/stale.ex" in lines
    assert File.regular?(Path.join(project, "lib/real_py/my_model/module.ex"))
    refute File.exists?(Path.join(project, "lib/real_py/stale.ex"))
  end

  test "the library's naming: diff/3 and write/3 follow no link out of lib/vllm",
       %{project: project, outside: outside, before: before} do
    files = %{"lib/vllm/x/module.ex" => @marker <> "defmodule X do\nend\n"}
    link!(outside, project, "lib/vllm/link")
    link!(Path.join(outside, "precious.ex"), project, "lib/vllm/old.ex")
    File.mkdir_p!(Path.join(project, "priv/bindings"))
    link!(Path.join(outside, "precious.ex"), project, "priv/bindings/old.json")

    assert Generator.diff(files, project) == {["lib/vllm/x/module.ex"], []}
    assert Generator.write(files, project) == ["lib/vllm/x/module.ex"]
    assert Generator.diff(files, project) == {[], []}
    assert snapshot(outside) == before

    # A file to write whose folder links outside: write/3 refuses it, writing nothing.
    link!(outside, project, "lib/vllm/y")
    files = Map.put(files, "lib/vllm/y/module.ex", @marker)

    assert_raise ArgumentError, ~r"lib/vllm/y/module.ex.*outside the project", fn ->
      Generator.write(files, project)
    end

    assert snapshot(outside) == before
  end
end
