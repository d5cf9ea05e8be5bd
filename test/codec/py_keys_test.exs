defmodule VllmBridge.PyKeysTest.Unregistered do
  @moduledoc false
  # Declares its Python class, and is never registered (VllmBridge.Codec.Registry).
  defstruct [:x]
  def __python_class__, do: "tests.unregistered.U"
  def __python_fields__, do: [:x]
end

defmodule VllmBridge.Codec.PyKeysTest do
  @moduledoc """
  What Python can never take as it was sent is refused by the encoder, naming it: map keys
  Python cannot hash, map keys Python holds equal (it would keep one, silently), nesting
  past `VllmBridge.Codec.max_depth/0`; and by `VllmBridge.Call.Wire`, naming the argument, with
  keyword arguments given twice. Everything else still encodes, and round trips.
  """
  use ExUnit.Case, async: true

  alias VllmBridge.{Codec, Object, Ref, Tensor}
  alias VllmBridge.Call.Wire
  import Bitwise, only: [<<<: 2]

  alias VllmBridge.Codec.{Ext, Msgpack, PyKeys}
  alias Vllm.ForwardContext.BatchDescriptor

  defp refusal(term) do
    Codec.encode(term)
    flunk("#{inspect(term)} was encoded")
  rescue
    e in ArgumentError -> Exception.message(e)
  end

  defp round_trip(term), do: Codec.decode(IO.iodata_to_binary(Codec.encode(term)))

  defp nest(n, leaf, wrap), do: Enum.reduce(1..n//1, leaf, fn _, acc -> wrap.(acc) end)

  describe "keys Python holds equal are refused, naming both" do
    # Each pair of keys is one dict key in Python.
    @colliding [
      {1, true, "true == 1"},
      {0, false, "true == 1 and false == 0"},
      {1, 1.0, "a float equal to an integer"},
      {0, -0.0, "a float equal to an integer"},
      {1.0, true, "true == 1"},
      {Integer.pow(10, 20), 1.0e20, "a float equal to an integer"},
      {Integer.pow(2, 70), Integer.pow(2, 70) * 1.0, "a float equal to an integer"},
      {:a, "a", "an atom arrives as the string of its name"},
      {:héllo, "héllo", "an atom arrives as the string of its name"},
      {{1, "a"}, {true, :a}, "their elements are equal"},
      {{1, {2.0}}, {1.0, {2}}, "their elements are equal"}
    ]

    for {a, b, why} <- @colliding do
      test "#{inspect(a)} and #{inspect(b)}" do
        a = unquote(Macro.escape(a))
        b = unquote(Macro.escape(b))
        message = refusal(%{a => :first, b => :second})
        assert message =~ "the map keys"
        assert message =~ inspect(a) and message =~ inspect(b)
        assert message =~ unquote(why)
        # also when the map sits deep inside something else
        assert refusal([1, {2, %{"k" => [%{a => 1, b => 2}]}}]) =~ "equal in Python"
      end
    end

    test "structs with fields Python holds equal" do
      message =
        refusal(%{
          %BatchDescriptor{num_tokens: 1} => :a,
          %BatchDescriptor{num_tokens: 1.0} => :b
        })

      assert message =~ "equal in Python"

      o1 = %Object{class: "m.C", fields: %{"x" => 1, "y" => :a}, field_order: ["x", "y"]}
      o2 = %Object{class: "m.C", fields: %{"x" => true, "y" => "a"}, field_order: ["y", "x"]}
      assert refusal(%{o1 => 1, o2 => 2}) =~ "equal in Python"
    end

    test "a struct and an Object of its class with equal fields: one dataclass in Python" do
      bd = %BatchDescriptor{num_tokens: 4, num_reqs: 2}

      fields =
        for f <- BatchDescriptor.__python_fields__(), into: %{}, do: {"#{f}", Map.get(bd, f)}

      for order <- [[], Map.keys(fields), Enum.reverse(Map.keys(fields))] do
        object = %Object{
          class: BatchDescriptor.__python_class__(),
          fields: fields,
          field_order: order
        }

        message = refusal(%{bd => 1, object => 2})
        assert message =~ "equal in Python (dataclasses of one class with fields equal"

        # Fields Python holds equal (4 and 4.0), as keys of keys too.
        object = %{object | fields: %{fields | "num_tokens" => 4.0}}
        assert refusal(%{{:k, bd} => 1, {:k, object} => 2}) =~ "equal in Python"
      end

      # Another class, or another value: two keys.
      other = %Object{class: "m.Other", fields: fields}
      assert {:ok, _} = round_trip(%{bd => 1, other => 2})
      assert {:ok, _} = round_trip(%{bd => 1, %{bd | num_tokens: 5} => 2})
    end

    test "structs of a module that declares its class but is not registered" do
      key = fn x -> %VllmBridge.PyKeysTest.Unregistered{x: x} end
      assert :error = VllmBridge.Codec.Registry.lookup("tests.unregistered.U")
      assert refusal(%{key.(1) => :a, key.(true) => :b}) =~ "equal in Python"

      assert refusal(%{
               key.(1) => :a,
               %Object{class: "tests.unregistered.U", fields: %{"x" => 1.0}} => :b
             }) =~ "equal in Python"

      assert {:ok, _} = round_trip(%{key.(1) => :a, key.(2) => :b})
    end
  end

  describe "an Object's field names must be strings" do
    test "any other field name is refused by name, as a key or a value" do
      for {fields, bad} <- [
            {%{:a => 1}, ":a"},
            {%{"a" => 1, :a => 2}, ":a"},
            {%{1 => 1}, "1"},
            {%{<<0xFF>> => 1}, "<<255>>"},
            {%{{"a"} => 1}, ~s({"a"})}
          ] do
        object = %Object{class: "m.C", fields: fields}

        for term <- [object, [object], %{object => 1}, %{"k" => object}] do
          message = refusal(term)
          assert message =~ "field names must be strings"
          assert message =~ "got #{bad}"
        end
      end
    end
  end

  describe "keys Python cannot hash are refused, naming the key" do
    for {key, kind} <- [
          {[1], "is a list"},
          {[], "is a list"},
          {%{}, "is a map"},
          {%{"a" => 1}, "is a map"},
          {{1, [2]}, "holds a list"},
          {{1, {2, %{}}}, "holds a map"}
        ] do
      test "#{inspect(key)}" do
        key = unquote(Macro.escape(key))
        message = refusal(%{key => 1})
        assert message =~ "the map key #{inspect(key)} #{unquote(kind)}"
        assert message =~ "cannot hash"
        # whatever else the map holds, and however deep it sits
        assert refusal([%{"ok" => 1, :ok => 2, key => 3}]) =~ "cannot hash"
      end
    end

    test "a struct key holding a list" do
      assert refusal(%{%BatchDescriptor{num_tokens: [1]} => 1}) =~ "holds a list"
    end
  end

  describe "keys Python keeps apart still encode, and round trip" do
    test "mixed keys that are distinct in Python" do
      term = %{
        1 => :int,
        2.5 => :float,
        "1" => :str,
        :x => :atom,
        nil => :none,
        "nil" => :str_nil,
        true => :t,
        false => :f,
        :nan => :nan,
        :infinity => :inf,
        {1, "a"} => :tuple,
        {2, :b} => :tuple2,
        <<0xFF>> => :bytes,
        %Ref{instance: "i", id: 1, session: nil, type: "t", node: node()} => :ref1,
        %Ref{instance: "i", id: 2, session: nil, type: "t", node: node()} => :ref2,
        Tensor.from_list([1], :int64) => :tensor,
        %BatchDescriptor{num_tokens: 8} => :bd8,
        %BatchDescriptor{num_tokens: 16} => :bd16
      }

      # true == 1 in Python: only without 1 and 0 beside them
      term = Map.drop(term, [1])
      assert round_trip(term) == {:ok, term}
    end

    test "all-atom, all-integer and all-string maps take no check at all" do
      for term <- [%{a: 1, b: 2, nil: 3, true: 4}, %{1 => 1, 2 => 2, -3 => 3}, %{"a" => 1}] do
        assert round_trip(term) == {:ok, term}
      end
    end
  end

  describe "the fast paths agree with the general check" do
    # Ext.check_keys/1 passes all-atom and all-integer keys without PyKeys; the engine does
    # not call the handler at all when the first key in term order is a binary (binaries
    # sort last: then every key is one). Each skip must only ever skip maps PyKeys.check!
    # passes, and encoding must refuse exactly the maps it refuses.
    @atoms [nil, true, false, :nan, :infinity, :neg_infinity, :a, :b, :"1", nil, true, :é]
    @others [0, 1, -1, 1.0, -0.0, 2.5, "a", "1", <<0xFF>>, {1}, {true}, {:a, "a"}, [1], %{}]

    defp key(:atom), do: Enum.random(@atoms)
    defp key(:integer), do: Enum.random([0, 1, -1, 2, 255, -129, 1 <<< 64, -(1 <<< 70)])

    defp key(:binary),
      do: Enum.random(["", "a", "b", "1", "nil", "true", <<0xFF>>, <<0xFF, 0>>, "é"])

    defp key(:mixed), do: key(Enum.random([:atom, :integer, :binary, :other]))
    defp key(:other), do: Enum.random(@others)

    defp verdict(pairs) do
      PyKeys.check!(pairs)
    rescue
      e in ArgumentError -> {:refused, Exception.message(e)}
    end

    test "on seeded random maps of every kind of key" do
      :rand.seed(:exsss, {5, 6, 7})

      paths =
        for _ <- 1..4_000, reduce: %{engine: 0, ext: 0, checked: 0, refused: 0} do
          paths ->
            kind = Enum.random([:atom, :integer, :binary, :mixed, :mixed])
            map = Map.new(1..:rand.uniform(6), fn i -> {key(kind), i} end)
            pairs = :lists.keysort(1, :maps.to_list(map))
            verdict = verdict(pairs)

            path =
              cond do
                match?([{k, _} | _] when is_binary(k), pairs) -> :engine
                Enum.all?(pairs, &is_atom(elem(&1, 0))) -> :ext
                Enum.all?(pairs, &is_integer(elem(&1, 0))) -> :ext
                true -> :checked
              end

            if path != :checked do
              assert verdict == :ok, "#{inspect(map)} skipped the check: #{inspect(verdict)}"
            end

            if path == :engine, do: assert(Enum.all?(pairs, &is_binary(elem(&1, 0))))
            if path == :ext, do: assert(Ext.check_keys(pairs) == :ok)

            # Encoding refuses exactly what the check refuses, with its words.
            case verdict do
              :ok ->
                assert {:ok, ^map} = round_trip(map)
                Map.update!(paths, path, &(&1 + 1))

              {:refused, why} ->
                assert refusal(map) == why
                paths |> Map.update!(path, &(&1 + 1)) |> Map.update!(:refused, &(&1 + 1))
            end
        end

      assert paths.engine > 500 and paths.ext > 1_000 and paths.checked > 1_000 and
               paths.refused > 300,
             inspect(paths)
    end
  end

  describe "nesting" do
    @max Msgpack.max_depth()

    test "is #{@max} levels, each list, map, tuple, struct and reference counting one" do
      ref = %Ref{instance: "i", id: 1, session: nil, type: "t"}

      wrappers = [
        fn x -> [x] end,
        fn x -> %{"k" => x} end,
        fn x -> {x} end,
        fn x -> %Object{class: "m.C", fields: %{"f" => x}, field_order: ["f"]} end
      ]

      for wrap <- wrappers do
        assert {:ok, _} = round_trip(nest(@max, 1, wrap))
        assert refusal(nest(@max + 1, 1, wrap)) =~ "nested deeper than #{@max} levels"
        # a container at the last level counts, empty or not; a reference nests a payload
        assert refusal(nest(@max, [], wrap)) =~ "nested deeper"
        assert refusal(nest(@max, ref, wrap)) =~ "nested deeper"
        assert {:ok, _} = round_trip(nest(@max - 1, ref, wrap))
      end

      mixed = Enum.reduce(1..@max, 1, fn i, acc -> Enum.at(wrappers, rem(i, 4)).(acc) end)
      assert {:ok, _} = round_trip(mixed)
      assert refusal([mixed]) =~ "nested deeper"
    end

    test "each argument may nest the whole depth; the error names the argument" do
      deep = nest(@max, 1, &[&1])
      assert {:ok, _} = Wire.encode_invoke({"m", "f"}, [deep, deep], k: deep)

      assert {:error, %{type: :bad_argument, message: "args[1]: " <> why}} =
               Wire.encode_invoke({"m", "f"}, [1, [deep]], [])

      assert why =~ "nested deeper than #{@max} levels"

      assert {:error, %{type: :bad_argument, message: "kwargs[\"k\"]: " <> _}} =
               Wire.encode_invoke({"m", "f"}, [], k: [deep])
    end
  end

  describe "Wire names the argument and refuses keyword arguments given twice" do
    test "a refused key inside an argument" do
      assert {:error, %{type: :bad_argument, message: message}} =
               Wire.encode_invoke({"m", "f"}, [1, [%{[1] => 2}]], [])

      assert message =~ "args[1]: the map key [1] is a list"

      assert {:error, %{message: "kwargs[\"opt\"]: the map keys 1 and true" <> _}} =
               Wire.encode_invoke({"m", "f"}, [], opt: %{1 => :a, true => :b})
    end

    test "a keyword given twice, as atoms or as an atom and a string" do
      for kw <- [[a: 1, a: 2], [{:a, 1}, {"a", 2}], %{:a => 1, "a" => 2}] do
        assert {:error, %{type: :bad_argument, message: message}} =
                 Wire.encode_invoke({"m", "f"}, [], kw)

        assert message =~ ~s(the keyword argument "a" is given twice)
      end
    end

    test "arguments encode to the bytes of the list and the map as a whole" do
      args = [40, %{"a" => [1, {2}]}, :ok]
      kw = %{"b" => 1, "a" => %{x: 1}}
      {:ok, [_target | parts]} = Wire.encode_invoke({"m", "f"}, args, kw)

      assert IO.iodata_to_binary(parts) ==
               IO.iodata_to_binary([Codec.encode(args), Codec.encode(kw)])
    end
  end
end
