defmodule VllmBridge.Bindings.ArgsTest do
  @moduledoc """
  The argument rule of the generated bindings (`VllmBridge.Bindings`), on the spec of a
  Python `f(a: int, b: Any, c: int = 1, d: list[int] | None = None, /?, *, e: int = 0)`.
  """
  use ExUnit.Case, async: true

  alias VllmBridge.Bindings.Args
  alias VllmBridge.Error

  @spec_f %{
    name: "Test.f",
    target: {"m", "f"},
    params: [
      {:a, :required, :int},
      {:b, :required, :any},
      {:c, :optional, :int},
      {:d, :optional, {:union, [{:list, :int}, :none]}},
      {:e, :keyword, :int}
    ]
  }

  defp split(args, spec \\ @spec_f), do: Args.split(spec, args)

  defp bad!(args, pattern, spec \\ @spec_f) do
    assert {:error, %Error{type: :bad_argument, message: message}} = split(args, spec)
    assert message =~ pattern
    message
  end

  test "required parameters only" do
    assert split([1, :x]) == {:ok, [1, :x], %{}, []}
  end

  test "optional parameters positionally, the arity range" do
    assert split([1, :x, 2]) == {:ok, [1, :x, 2], %{}, []}
    assert split([1, :x, 2, [3]]) == {:ok, [1, :x, 2, [3]], %{}, []}
    assert split([1, :x, 2, nil, []]) == {:ok, [1, :x, 2, nil], %{}, []}
  end

  test "optional and keyword-only parameters by name, with the runtime options" do
    assert split([1, :x, [d: [4], e: 5, __runtime__: [timeout: 10]]]) ==
             {:ok, [1, :x], %{"d" => [4], "e" => 5}, [timeout: 10]}

    assert split([1, :x, 2, [e: 5]]) == {:ok, [1, :x, 2], %{"e" => 5}, []}
  end

  test "a trailing keyword list between the arities is the options" do
    assert split([1, :x, []]) == {:ok, [1, :x], %{}, []}
    assert split([1, :x, [c: 3]]) == {:ok, [1, :x], %{"c" => 3}, []}
  end

  test "a keyword list with other keys in an optional place is refused, never passed on" do
    message = bad!([1, :x, [z: 1]], "unknown option :z")
    assert message =~ "known: :c, :d, :e, :__runtime__"
    assert message =~ "Test.f/3"
    bad!([1, :x, 2, [d: nil, z: 2]], "unknown option :z")
  end

  test "a keyword list (or []) as a positional value needs the options after it" do
    list_spec = %{
      @spec_f
      | params: [{:a, :required, :int}, {:c, :optional, :any}, {:d, :optional, :any}]
    }

    assert split([1, [z: 1], []], list_spec) == {:ok, [1, [z: 1]], %{}, []}
    assert split([1, [], []], list_spec) == {:ok, [1, []], %{}, []}
    assert split([1, [], [], []], list_spec) == {:ok, [1, [], []], %{}, []}
    # Without the options after it, [] is the (empty) options.
    assert split([1, []], list_spec) == {:ok, [1], %{}, []}
  end

  test "a non-keyword list in an optional place is a positional value" do
    assert split([1, :x, 2, [1, 2]]) == {:ok, [1, :x, 2, [1, 2]], %{}, []}
    assert {:error, %Error{message: message}} = split([1, :x, [1, 2]])
    assert message =~ "c must be integer(), got [1, 2]"
  end

  test "at the largest arity the last argument must be a keyword list" do
    bad!([1, :x, 2, nil, 5], "the last argument must be a keyword list of options, got 5")
    bad!([1, :x, 2, nil, [1]], "got [1]")
  end

  test "a parameter given both positionally and by name" do
    bad!([1, :x, 2, [c: 3]], "c given both positionally and as an option")
  end

  test "required parameters cannot be options; an option twice is refused" do
    bad!([1, :x, [a: 1]], "a is required and goes positionally")
    bad!([1, :x, [e: 1, e: 2]], "option :e given twice")
  end

  test "wrong arity" do
    bad!([1], "takes 2..5 arguments, got 1")
    bad!([1, :x, 2, nil, [], []], "takes 2..5 arguments, got 6")
    assert {:error, %Error{message: m}} = Args.split(%{@spec_f | name: "Test.with_f"}, [1], 1)
    assert m == "Test.with_f/2: takes 2..5 arguments before the function, got 1"
  end

  test "types are checked, positionally and by name" do
    bad!(["1", :x], ~s|a must be integer(), got "1"|)
    bad!([1, :x, 2, [:y]], "d must be [integer()] | nil, got [:y]")
    bad!([1, :x, [e: "5"]], ~s|e must be integer(), got "5"|)
  end

  test "positional-only parameters and required keyword-only ones" do
    spec = %{
      name: "Test.g",
      target: {"m", "g"},
      params: [{:a, :required, :int}, {:k, :required_keyword, :int}, {:p, :positional_only, :int}]
    }

    assert split([1, 2], spec) == {:ok, [1], %{"k" => 2}, []}
    assert split([1, 2, 3], spec) == {:ok, [1, 3], %{"k" => 2}, []}
    bad!([1, 2, [p: 3]], "p can only be given positionally", spec)
  end

  test "**kwargs lets any option name through" do
    spec = Map.put(@spec_f, :var_keyword, true)
    assert split([1, :x, [zz: 1]], spec) == {:ok, [1, :x], %{"zz" => 1}, []}
  end

  test "keyword?/1" do
    assert Args.keyword?([])
    assert Args.keyword?(a: 1, b: 2)
    refute Args.keyword?([{"a", 1}])
    refute Args.keyword?([{:a, 1}, 2])
    refute Args.keyword?([{:a, 1} | :improper])
    refute Args.keyword?(%{a: 1})
  end
end
