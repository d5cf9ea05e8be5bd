defmodule VllmBridge.Runtime.EchoFuzzTest.Sample do
  @moduledoc false
  # vllm_bridge.bridge.diag.Sample, a dataclass that is not frozen (Python cannot hash it), as a
  # struct that is never registered: used only as a map key.
  defstruct name: "s", level: :low, payload: nil
  def __python_class__, do: "vllm_bridge.bridge.diag.Sample"
  def __python_fields__, do: [:name, :level, :payload]
end

defmodule VllmBridge.Runtime.EchoFuzzTest do
  @moduledoc """
  10 000 seeded random nested terms (integers of every size, floats, binaries, atoms,
  tuples, lists, maps with mixed keys, tensors, dataclass structs and objects, references,
  deep chains) through `vllm_bridge.bridge.diag.echo` on a real worker: each comes back equal
  (`===`, a reference as a reference to the same object), or is refused with
  `:bad_argument`, never changed.

  The refusals are checked against Python itself: a term the Elixir side refuses for its
  map keys is sent anyway, encoded without the check, and the worker must refuse it too;
  a term the Elixir side passes is refused by the worker exactly when it holds what only
  Python can know (docs/PROTOCOL.md, "Map keys"): a key holding a dataclass that is not
  frozen, or two keys that are references to one object. So Elixir refuses exactly what
  Python could not take as sent, but for those. A term refused for its depth nests deeper
  than `VllmBridge.Codec.max_depth/0`.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import Bitwise
  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Bytes, Error, Object, Ref, Tensor}
  alias VllmBridge.Call.{Request, Wire}
  alias VllmBridge.Codec.Msgpack
  alias VllmBridge.Runtime.EchoFuzzTest.Sample
  alias VllmBridge.TestSupport.{TermGen, Unchecked}
  alias Vllm.ForwardContext.BatchDescriptor

  @pool :rt_echo_fuzz
  @terms 10_000
  @max Msgpack.max_depth()
  @descriptor BatchDescriptor.__python_class__()
  @key_refusal ~r/the map keys? .* (are equal in Python|Python cannot hash)/

  setup_all do
    start_pool!(@pool, size: 1)
    [w] = workers!(@pool)
    %{w: w}
  end

  test "random terms come back equal or are refused as Python would", %{w: w} do
    refs = refs!()
    :rand.seed(:exsss, {13, 7, 2026})

    counts =
      Enum.reduce(1..@terms, %{equal: 0, keys: 0, depth: 0, python: 0}, fn i, counts ->
        term = if rem(i, 50) == 0, do: deep_chain(), else: gen(4, refs)
        passes? = match?({:ok, _}, Wire.encode_invoke({"m", "f"}, [term], %{}))

        case VllmBridge.call({"vllm_bridge.bridge.diag", "echo"}, [term], %{}, pool_name: @pool) do
          {:ok, back} ->
            refute python_refuses?(term, refs), "term #{i} passed: #{inspect(term)}"

            assert same(back, refs) === same(expected(term), refs),
                   "term #{i} changed: #{inspect(term)} -> #{inspect(back)}"

            release(back)
            Map.update!(counts, :equal, &(&1 + 1))

          {:error, %Error{type: :bad_argument, message: "args[0]: " <> why}}
          when not passes? ->
            if why =~ "nested deeper than #{@max} levels" do
              assert depth(term) > @max, "term #{i} refused for depth: #{inspect(term)}"
              Map.update!(counts, :depth, &(&1 + 1))
            else
              assert why =~ @key_refusal
              assert {:error, %Error{type: :bad_argument, message: py}} = raw_echo(w.pid, term)

              assert py =~ ~r/^(could not decode )?args\[0\]/ and py =~ @key_refusal,
                     "term #{i}: #{inspect(term)}: #{py}"

              Map.update!(counts, :keys, &(&1 + 1))
            end

          {:error, %Error{type: :bad_argument, message: "args[0][" <> _ = why}} when passes? ->
            # What only Python can know: refused by the worker under the request's id.
            assert python_refuses?(term, refs), "term #{i} refused: #{inspect(term)}: #{why}"
            assert why =~ @key_refusal
            Map.update!(counts, :python, &(&1 + 1))

          other ->
            flunk("term #{i}: #{inspect(term, limit: 20)} gave #{inspect(other)}")
        end
      end)

    # Every class was exercised, and most terms travel.
    assert counts.equal > 8_000 and counts.keys > 100 and counts.depth > 50 and
             counts.python > 100,
           inspect(counts)
  end

  # References to use as keys: two to one object (`echo` hands back a new reference to
  # the object it was given), one to another. Each object's `value` names it.
  defp refs! do
    opaque = fn v ->
      {:ok, ref} =
        VllmBridge.call({"vllm_bridge.bridge.diag", "opaque"}, [v], %{}, pool_name: @pool)

      ref
    end

    a = opaque.(101)

    {:ok, again} =
      VllmBridge.call({"vllm_bridge.bridge.diag", "echo"}, [a], %{}, pool_name: @pool)

    assert again.id != a.id
    [a, again, opaque.(102)]
  end

  # The object a reference stands for, by its `value` (bump by 0 returns it).
  defp object_of(%Ref{} = ref) do
    {:ok, v} = VllmBridge.call({ref, "bump"}, [0], %{}, pool_name: @pool)
    v
  end

  # A term with each reference replaced by the object it stands for.
  defp same(%Ref{} = ref, _refs), do: {:object, object_of(ref)}
  defp same(l, refs) when is_list(l), do: Enum.map(l, &same(&1, refs))

  defp same(t, refs) when is_tuple(t),
    do: t |> Tuple.to_list() |> Enum.map(&same(&1, refs)) |> List.to_tuple()

  defp same(m, refs) when is_map(m) and not is_struct(m),
    do: Map.new(m, fn {k, v} -> {same(k, refs), same(v, refs)} end)

  defp same(x, _refs), do: x

  # The references a reply brought back (new ones, to the objects sent) go at once.
  defp release(back) do
    case Ref.collect(back) do
      [] -> :ok
      refs -> {:ok, _} = VllmBridge.release(refs, pool_name: @pool)
    end
  end

  # Whether the worker refuses a term the Elixir side passes: a map key that holds a
  # dataclass that is not frozen, or a map whose keys are equal once each reference is
  # taken for its object.
  defp python_refuses?(term, [a, again, _other]),
    do: unhashable_key?(term) or aliased?(term, again, a)

  # With `again` put where the reference `a` to the same object is: keys that become one
  # (`{again}` and `{a}`), or that the Elixir check then finds equal (`{again}`, `{a}`
  # beside `1` and `true`...).
  defp aliased?(m, again, a) when is_map(m) and not is_struct(m) do
    keys = m |> Map.keys() |> Enum.map(&replace(&1, again, a))

    length(Enum.uniq(keys)) < map_size(m) or
      match?({:error, _}, Wire.encode_invoke({"m", "f"}, [Map.new(keys, &{&1, nil})], %{})) or
      Enum.any?(m, fn {k, v} -> aliased?(k, again, a) or aliased?(v, again, a) end)
  end

  defp aliased?(l, again, a) when is_list(l), do: Enum.any?(l, &aliased?(&1, again, a))
  defp aliased?(t, again, a) when is_tuple(t), do: aliased?(Tuple.to_list(t), again, a)
  defp aliased?(_, _again, _a), do: false

  defp unhashable_key?(m) when is_map(m) and not is_struct(m),
    do:
      Enum.any?(m, fn {k, v} -> holds_sample?(k) or unhashable_key?(k) or unhashable_key?(v) end)

  defp unhashable_key?(l) when is_list(l), do: Enum.any?(l, &unhashable_key?/1)
  defp unhashable_key?(t) when is_tuple(t), do: unhashable_key?(Tuple.to_list(t))
  defp unhashable_key?(_), do: false

  defp holds_sample?(%Sample{}), do: true
  defp holds_sample?(t) when is_tuple(t), do: t |> Tuple.to_list() |> Enum.any?(&holds_sample?/1)
  defp holds_sample?(_), do: false

  # Keys only (no map can be a key: Elixir refuses those).
  defp replace(x, x, by), do: by

  defp replace(t, x, by) when is_tuple(t),
    do: t |> Tuple.to_list() |> Enum.map(&replace(&1, x, by)) |> List.to_tuple()

  defp replace(other, _x, _by), do: other

  defp raw_echo(pid, term) do
    args = [0x91 | Msgpack.encode(term, Unchecked, 2000)]
    parts = [Wire.value(["m", "vllm_bridge.bridge.diag", "echo"]), args, Wire.value(%{})]
    deadline = System.monotonic_time(:millisecond) + 30_000
    Request.call(pid, Request.new("call", pre: [Wire.value(nil)], post: parts), deadline)
  end

  # What comes back: %Bytes{} is how Elixir asks for msgpack bin; it returns as a binary;
  # an Object of a registered class as its struct.
  defp expected(%Bytes{data: d}), do: d
  defp expected(%Tensor{} = t), do: t
  defp expected(%Ref{} = r), do: r
  defp expected(%BatchDescriptor{} = b), do: b

  defp expected(%Object{class: @descriptor, fields: fields}),
    do: struct(BatchDescriptor, for({k, v} <- fields, do: {String.to_existing_atom(k), v}))

  defp expected(l) when is_list(l), do: Enum.map(l, &expected/1)

  defp expected(t) when is_tuple(t),
    do: t |> Tuple.to_list() |> Enum.map(&expected/1) |> List.to_tuple()

  defp expected(m) when is_map(m), do: Map.new(m, fn {k, v} -> {expected(k), expected(v)} end)
  defp expected(x), do: x

  defp depth(l) when is_list(l), do: 1 + Enum.reduce(l, 0, &max(depth(&1), &2))
  defp depth(t) when is_tuple(t), do: depth(Tuple.to_list(t))
  defp depth(%module{}) when module in [BatchDescriptor, Object, Ref, Sample], do: 1
  defp depth(%_{}), do: 0

  defp depth(m) when is_map(m),
    do: 1 + Enum.reduce(m, 0, fn {k, v}, acc -> max(acc, max(depth(k), depth(v))) end)

  defp depth(_), do: 0

  # -- the generator ---------------------------------------------------------------------

  defp gen(depth, refs) do
    TermGen.nested(depth,
      leaf: &leaf/0,
      key: &key/0,
      extras: [
        fn _sub -> [] end,
        fn sub -> Map.new(1..:rand.uniform(3), fn _ -> {string(), sub.()} end) end,
        fn _sub -> descriptor() end,
        fn _sub -> as_object(descriptor()) end,
        fn sub -> Map.new(1..:rand.uniform(3), fn _ -> {rare_key(refs), sub.()} end) end
      ]
    )
  end

  # A chain of 60 to 70 containers of every kind (the limit is 64).
  defp deep_chain do
    wrappers = [&[&1], &%{"k" => &1}, &{&1}, &%{1 => &1}]
    Enum.reduce(1..(59 + :rand.uniform(11)), leaf(), fn _, acc -> Enum.random(wrappers).(acc) end)
  end

  # Keys drawn so that some maps hold keys Python merges (1 and true, 1 and 1.0, :a and
  # "a", tuples of those) and a few hold keys Python cannot hash.
  @keys [
    0,
    1,
    2,
    true,
    false,
    1.0,
    -0.0,
    2.5,
    :a,
    "a",
    :b,
    "b",
    nil,
    "nil",
    {1, "a"},
    {true, :a},
    <<0xFF>>,
    1 <<< 70,
    (1 <<< 70) * 1.0,
    :nan,
    :infinity
  ]
  @unhashable [[1], %{}, {1, [2]}, %{"x" => 1}]

  defp key do
    case :rand.uniform(40) do
      1 -> Enum.random(@unhashable)
      n when n <= 20 -> Enum.random(@keys)
      n when n <= 30 -> TermGen.integer()
      _ -> string()
    end
  end

  # Keys only Python's dataclasses and objects can compare: structs and objects of one
  # frozen dataclass (equal when their fields are, a struct and an object alike), a
  # dataclass that is not frozen, references (two of them to one object), and tuples
  # holding them; mixed with plain keys.

  defp rare_key(refs) do
    # (BatchDescriptor checks its fields' types: 1.0 or true is no num_tokens.)
    one = %BatchDescriptor{num_tokens: 1}
    two = %BatchDescriptor{num_tokens: 2, uniform: true}

    Enum.random([
      one,
      two,
      as_object(one),
      as_object(two),
      {1, one},
      {true, as_object(one)},
      {1.0, two},
      %Sample{},
      {:s, %Sample{name: "t"}},
      Enum.random(refs),
      {Enum.random(refs)},
      1,
      "a"
    ])
  end

  defp as_object(%BatchDescriptor{} = b) do
    fields = for f <- BatchDescriptor.__python_fields__(), into: %{}, do: {"#{f}", Map.get(b, f)}
    %Object{class: @descriptor, fields: fields, field_order: Enum.shuffle(Map.keys(fields))}
  end

  defp leaf do
    case :rand.uniform(11) do
      1 -> Enum.random([nil, true, false])
      2 -> TermGen.integer()
      3 -> TermGen.float()
      4 -> Enum.random([:nan, :infinity, :neg_infinity, -0.0, 1.0, 1.0e20])
      5 -> string()
      6 -> TermGen.bytes([0, 3, 40])
      7 -> %Bytes{data: string()}
      8 -> Enum.random([:ok, :error, :full, :"an atom", :a])
      9 -> TermGen.tensor(2, 2)
      10 -> descriptor()
      11 -> {}
    end
  end

  defp string, do: TermGen.string([0, 1, 2, 5, 33])

  defp descriptor do
    %BatchDescriptor{
      num_tokens: :rand.uniform(512) - 1,
      num_reqs: Enum.random([nil, :rand.uniform(64)]),
      uniform: :rand.uniform(2) == 1,
      has_lora: :rand.uniform(2) == 1,
      num_active_loras: :rand.uniform(4) - 1
    }
  end
end
