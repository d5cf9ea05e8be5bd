defmodule VllmBridge.Bindings.Gen.Tree do
  @moduledoc false
  # The file-system side of `mix vllm.gen.bindings`, which deletes and writes files under
  # its output folders and must touch nothing outside the project. Symbolic links are where
  # that could go wrong (`Path.wildcard("**")` and `File.write` follow them), so:
  #
  #   * an output folder counts only when its real path (every link resolved) is inside the
  #     project's real root, and is not the root itself;
  #   * below it, the walk for stale files lists regular files only and descends into real
  #     folders only (`File.lstat`): a linked folder is not entered, a linked file is never
  #     a stale file (nor is it deleted: the link is the user's);
  #   * a file is written only when the real path of its folder is inside the project and
  #     the file itself is not a link (writing would replace what the link points at).

  @max_links 40

  @doc """
  The real path of `path` (made absolute against the current folder): every symbolic link
  resolved; the parts that do not exist are kept as they are. `{:error, link}` for a loop
  (more than #{@max_links} links).
  """
  @spec real(Path.t()) :: {:ok, String.t()} | {:error, String.t()}
  def real(path), do: resolve("/", Path.split(Path.expand(path)) |> tl(), 0)

  defp resolve(acc, [], _links), do: {:ok, acc}

  defp resolve(acc, _parts, links) when links > @max_links, do: {:error, acc}

  defp resolve(acc, [part | rest], links) do
    next = Path.join(acc, part)

    case File.lstat(next) do
      {:ok, %File.Stat{type: :symlink}} ->
        case File.read_link(next) do
          # The target is relative to the link's folder, `acc`, which is already real.
          {:ok, target} ->
            with {:ok, real_target} <-
                   resolve("/", Path.split(Path.expand(target, acc)) |> tl(), links + 1) do
              resolve(real_target, rest, links + 1)
            end

          {:error, _} ->
            resolve(next, rest, links)
        end

      _ ->
        resolve(next, rest, links)
    end
  end

  @doc "Whether the real path `path` is `root` or below it (both real)."
  @spec inside?(String.t(), String.t()) :: boolean()
  def inside?(path, root), do: path == root or String.starts_with?(path, root <> "/")

  @doc """
  The real path of the folder `dir` (relative to `root`) when it is inside the project
  and is not its root; else why not: `:root`, `{:outside, real_path}`, `{:loop, link}`.
  """
  @spec folder(String.t(), String.t()) ::
          {:ok, String.t()} | {:error, :root | {:outside, String.t()} | {:loop, String.t()}}
  def folder(root, dir) do
    with {:ok, real_root} <- real(root),
         {:ok, real_dir} <- real(Path.join(root, dir)) do
      cond do
        real_dir == real_root -> {:error, :root}
        inside?(real_dir, real_root) -> {:ok, real_dir}
        true -> {:error, {:outside, real_dir}}
      end
    else
      {:error, link} -> {:error, {:loop, link}}
    end
  end

  @doc """
  The regular files under the folder `dir` whose names end with `ext`, as paths relative
  to `dir`, sorted; `recursive: false` lists `dir` alone. Links (to files or folders) are
  neither listed nor followed, nor are names starting with a dot (as `Path.wildcard/1`).
  """
  @spec files(String.t(), String.t(), keyword()) :: [String.t()]
  def files(dir, ext, opts \\ []), do: walk(dir, "", ext, Keyword.get(opts, :recursive, true))

  defp walk(dir, rel, ext, recursive) do
    case File.ls(Path.join(dir, rel)) do
      {:ok, names} ->
        names
        |> Enum.reject(&String.starts_with?(&1, "."))
        |> Enum.sort()
        |> Enum.flat_map(fn name ->
          path = if rel == "", do: name, else: Path.join(rel, name)

          case File.lstat(Path.join(dir, path)) do
            {:ok, %File.Stat{type: :directory}} when recursive ->
              walk(dir, path, ext, true)

            {:ok, %File.Stat{type: :regular}} ->
              if String.ends_with?(name, ext), do: [path], else: []

            _ ->
              []
          end
        end)

      {:error, _} ->
        []
    end
  end

  @doc """
  Why the file `path` (relative to `root`) may not be written, or `nil` when it may: the
  real path of its folder must be inside the project, and the file must not be a link.
  """
  @spec unwritable(String.t(), String.t()) :: String.t() | nil
  def unwritable(root, path) do
    full = Path.join(root, path)

    with {:ok, real_root} <- real(root),
         {:ok, real_dir} <- real(Path.dirname(full)) do
      cond do
        not inside?(real_dir, real_root) ->
          "#{path}: its folder leads outside the project (to #{real_dir}) through a symbolic link"

        match?({:ok, %File.Stat{type: :symlink}}, File.lstat(full)) ->
          "#{path} is a symbolic link (to #{read_link(full)}); the task writes no file through a link"

        true ->
          nil
      end
    else
      {:error, link} -> "#{path}: a loop of symbolic links at #{link}"
    end
  end

  defp read_link(path) do
    case File.read_link(path) do
      {:ok, target} -> target
      {:error, _} -> "?"
    end
  end
end
