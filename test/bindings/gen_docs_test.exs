defmodule VllmBridge.Bindings.GenDocsTest do
  @moduledoc "Docstrings -> markdown, and markdown -> heredoc source."
  use ExUnit.Case, async: true

  alias VllmBridge.Bindings.Gen.Docs

  test "reST inline markup becomes markdown" do
    {md, %{}} = Docs.convert("Use ``x + 1`` with :func:`set_forward_context` and :class:`~a.B`.")
    assert md == "Use `x + 1` with `set_forward_context` and `a.B`."
  end

  test "Args and Attributes are taken out by name; other sections become headings" do
    doc = """
    Summary line.

    Args:
        alpha: The first
            one, continued.
        beta (int): Second.

    Returns:
        The sum.

    Raises:
        ValueError / TypeError: a bad value.
        RuntimeError: no context.
    """

    {md, described} = Docs.convert(doc)
    assert described == %{"alpha" => "The first one, continued.", "beta" => "Second."}

    assert md ==
             """
             Summary line.

             ## Returns

             The sum.

             ## Raises

               * `ValueError / TypeError` - a bad value.
               * `RuntimeError` - no context.
             """
             |> String.trim()
  end

  test "a reST simple table is kept in a code block" do
    doc = "Modes:\n\n===== ====\nname value\n===== ====\nNONE  0\n===== ====\n\nAfter."
    {md, _} = Docs.convert(doc)
    assert md =~ "```\n===== ====\nname value\n===== ====\nNONE  0\n===== ====\n```\n\nAfter."
  end

  test "heredoc source escapes what Elixir would interpret" do
    text = ~S'a \n #{x} """ b'
    source = Docs.heredoc(text)
    {value, _} = Code.eval_string("x = 1\n" <> source)
    assert value == text <> "\n"
  end

  test "nil docstrings; parts/1 keeps the sections apart" do
    assert Docs.convert(nil) == {"", %{}}

    assert Docs.parts("Raises:\n    KeyError: missing.\n\nYields:\n    Numbers.") == %{
             body: "",
             described: %{},
             sections: [{"Raises", "  * `KeyError` - missing."}, {"Yields", "Numbers."}]
           }

    assert Docs.convert("Yields:\n    Numbers.") == {"## Yields\n\nNumbers.", %{}}
  end
end
