defmodule VllmBridge.Bindings.JsonTest do
  @moduledoc "The manifests' JSON: deterministic pretty encoding, a strict decoder."
  use ExUnit.Case, async: true

  alias VllmBridge.Bindings.Json

  test "encodes pretty, with sorted keys and a final newline" do
    value = %{"b" => [1, 2.5, nil], "a" => %{"y" => true, "x" => false}, "c" => [], "d" => %{}}

    assert Json.encode!(value) == """
           {
             "a": {
               "x": false,
               "y": true
             },
             "b": [
               1,
               2.5,
               null
             ],
             "c": [],
             "d": {}
           }
           """
  end

  test "escapes strings and keeps non-ASCII text" do
    assert Json.encode!(~s(a"b\\c\nd\te\u0001é€)) == ~s("a\\"b\\\\c\\nd\\te\\u0001é€"\n)
  end

  test "encode then decode is the identity on JSON values" do
    values = [
      nil,
      true,
      0,
      -17,
      Integer.pow(2, 70),
      0.1,
      -0.0,
      1.0e-5,
      1.0e300,
      "",
      "snowman ☃ and 𝄞",
      [],
      %{},
      [%{"k" => [1, [2, [3]]], "" => "empty key"}]
    ]

    for v <- values do
      assert Json.decode(Json.encode!(v)) == {:ok, v}
    end
  end

  test "decodes standard JSON" do
    text =
      ~s( {"a" : [1, -2.5e2, 3E1, 0.5, true, false, null], "s": "\\u00e9\\ud834\\udd1e\\/\\b"} )

    assert Json.decode(text) ==
             {:ok, %{"a" => [1, -250.0, 30.0, 0.5, true, false, nil], "s" => "é𝄞/\b"}}
  end

  test "refuses bad JSON, naming the byte offset" do
    for {text, message} <- [
          {"", "expected a JSON value at byte 0"},
          {"[1, 2", "expected ',' or ']' in an array at byte 5"},
          {~s({"a" 1}), "expected ':' after an object key at byte 5"},
          {~s({"a": 1, "a": 2}), "duplicate object key \"a\""},
          {~s({1: 2}), "expected a string key"},
          {~s("abc), "unterminated string"},
          {~s("\\x"), "bad escape"},
          {~s("\\ud834"), "unpaired UTF-16 surrogate"},
          {"[01]", "expected ',' or ']'"},
          {"nul", "expected a JSON value"},
          {"1 2", "unexpected text after the value at byte 2"},
          {<<?", 0xFF, ?">>, "invalid UTF-8"}
        ] do
      assert {:error, got} = Json.decode(text)
      assert got =~ message, "#{inspect(text)}: #{got}"
    end

    assert_raise ArgumentError, ~r/at byte 0/, fn -> Json.decode!("") end
  end

  test "refuses to encode what JSON cannot hold" do
    for bad <- [:atom, {1, 2}, %{1 => 2}, <<0xFF>>, self()] do
      assert_raise ArgumentError, fn -> Json.encode!(bad) end
    end
  end
end
