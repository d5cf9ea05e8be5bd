defmodule VllmBridge.Bindings.Gen.Docs do
  @moduledoc false
  # Python docstrings as ExDoc markdown, and markdown as Elixir heredoc source.
  #
  #   * reST inline markup: ``` ``code`` ``` -> `` `code` ``, `` :func:`name` `` -> `` `name` ``;
  #   * Google-style sections: `Args:` / `Arguments:` / `Parameters:` / `Attributes:` are
  #     taken out and returned by name (the generator puts each description next to its
  #     parameter or field); other sections (`Returns:`, `Raises:`, `Yields:`, ...) are
  #     returned apart (`parts/1`) or as `## ` headings after the prose (`convert/1`), their
  #     `name: text` items a list;
  #   * reST simple tables (`=== ===` rules) are kept verbatim in a code block; `::` ending a
  #     paragraph becomes `:` (the indented block after it is markdown code already).

  @item_sections ~w(Args Arguments Parameters Attributes)
  @sections ~w(Returns Yields Raises Note Notes Example Examples Warning Warnings See)

  @typedoc "A converted docstring: prose, `Args:`-style descriptions by name, other sections."
  @type parts :: %{
          body: String.t(),
          described: %{String.t() => String.t()},
          sections: [{String.t(), String.t()}]
        }

  @doc """
  Converts a docstring: `{markdown, descriptions}` where `descriptions` maps the names of
  the `Args:`/`Attributes:` items to their text, and the other sections follow the prose
  as `## ` headings.
  """
  @spec convert(String.t() | nil) :: {String.t(), %{String.t() => String.t()}}
  def convert(doc) do
    %{body: body, described: described, sections: sections} = parts(doc)

    headed = Enum.map(sections, fn {name, md} -> "## #{name}\n\n#{md}" end)
    {[body | headed] |> Enum.reject(&(&1 == "")) |> Enum.join("\n\n"), described}
  end

  @doc "Converts a docstring into its parts (see `t:parts/0`), sections in their order."
  @spec parts(String.t() | nil) :: parts()
  def parts(nil), do: %{body: "", described: %{}, sections: []}

  def parts(doc) do
    {lines, described, sections} = doc |> inline() |> String.split("\n") |> sections([], %{}, [])

    %{
      body: markdown(lines),
      described: described,
      sections: for({name, block} <- Enum.reverse(sections), do: {name, markdown(block)})
    }
  end

  # Blank lines around dropped, the first line's indentation (a list item's) kept.
  defp markdown(lines) do
    lines
    |> tables()
    |> Enum.join("\n")
    |> String.replace(~r/\n{3,}/, "\n\n")
    |> String.replace(~r/\A(?:[ \t]*\n)+/, "")
    |> String.trim_trailing()
  end

  @doc ~S'Elixir source of a heredoc holding `text` (`\`, `#{` and `"""` escaped).'
  @spec heredoc(String.t()) :: String.t()
  def heredoc(text) do
    body =
      text
      |> String.replace("\\", "\\\\")
      |> String.replace("\#{", "\\\#{")
      |> String.replace(~s("""), ~s(\\"""))

    ~s("""\n#{body}\n""")
  end

  defp inline(text) do
    text
    |> String.replace(~r/``(.+?)``/s, "`\\1`")
    |> String.replace(
      ~r/:(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const):`~?([^`]+)`/,
      "`\\1`"
    )
    |> String.replace(~r/::$/m, ":")
  end

  # Google-style sections: lines of `Name:` alone, then an indented block.
  defp sections([], acc, described, found), do: {Enum.reverse(acc), described, found}

  defp sections([line | rest], acc, described, found) do
    case Regex.run(~r/^(\w+):\s*$/, line) do
      [_, name] when name in @item_sections ->
        {block, rest} = indented(rest)
        sections(rest, acc, Map.merge(described, Map.new(items(block))), found)

      [_, name] when name in @sections ->
        {block, rest} = indented(rest)
        sections(rest, acc, described, [{name, section_body(block)} | found])

      _ ->
        sections(rest, [line | acc], described, found)
    end
  end

  defp indented(lines) do
    Enum.split_while(lines, &(String.trim(&1) == "" or String.starts_with?(&1, [" ", "\t"])))
    |> then(fn {block, rest} ->
      # Trailing blank lines belong to what follows.
      trailing = block |> Enum.reverse() |> Enum.take_while(&(String.trim(&1) == ""))
      {Enum.drop(block, -length(trailing)), trailing ++ rest}
    end)
  end

  @item ~r/^\s*([\w.*\/ ]+?)(?:\s*\([^)]*\))?:\s+(.*)$/

  # `name: text` (or `name (type): text`) items, continuation lines joined.
  defp items(block) do
    lines = Enum.reject(block, &(String.trim(&1) == ""))
    base = lines |> Enum.map(&indent/1) |> Enum.min(fn -> 0 end)

    lines
    |> Enum.reduce([], fn line, acc ->
      case {indent(line) == base, Regex.run(@item, line <> " ")} do
        {true, [_, name, text]} -> [{String.trim(name), String.trim(text)} | acc]
        {_, _} when acc == [] -> acc
        {_, _} -> [{elem(hd(acc), 0), elem(hd(acc), 1) <> " " <> String.trim(line)} | tl(acc)]
      end
    end)
    |> Enum.reverse()
    |> Enum.map(fn {name, text} -> {name, String.trim(text)} end)
  end

  # A section whose every head line is `name: text` becomes a list; any other, prose.
  defp section_body(block) do
    lines = Enum.reject(block, &(String.trim(&1) == ""))
    base = lines |> Enum.map(&indent/1) |> Enum.min(fn -> 0 end)
    heads = Enum.filter(lines, &(indent(&1) == base))

    if heads != [] and Enum.all?(heads, &Regex.match?(@item, &1 <> " ")),
      do: Enum.map(items(block), fn {name, text} -> "  * `#{name}` - #{text}" end),
      else: dedent(block)
  end

  defp dedent(block) do
    base =
      block
      |> Enum.reject(&(String.trim(&1) == ""))
      |> Enum.map(&indent/1)
      |> Enum.min(fn -> 0 end)

    Enum.map(block, &String.slice(&1, base..-1//1))
  end

  defp indent(line), do: byte_size(line) - byte_size(String.trim_leading(line))

  # reST simple tables: from the first `=== ===` rule to the last one of the block.
  defp tables(lines), do: tables(lines, [])
  defp tables([], acc), do: Enum.reverse(acc)

  defp tables([line | rest] = lines, acc) do
    if rule?(line) do
      {block, after_block} = Enum.split_while(lines, &(String.trim(&1) != ""))

      last =
        block |> Enum.with_index() |> Enum.filter(&rule?(elem(&1, 0))) |> List.last() |> elem(1)

      {table, tail} = Enum.split(block, last + 1)
      tables(tail ++ after_block, Enum.reverse(["```"] ++ table ++ ["```"]) ++ acc)
    else
      tables(rest, [line | acc])
    end
  end

  defp rule?(line), do: line =~ ~r/^=+( +=+)+\s*$/
end
