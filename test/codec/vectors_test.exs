defmodule VllmBridge.Codec.VectorsTest do
  @moduledoc """
  Every vector of priv/protocol/vectors.txt: encoding the native value gives exactly the
  bytes, decoding the bytes gives the value (docs/PROTOCOL.md, "Byte vectors").
  """
  use ExUnit.Case, async: true

  alias VllmBridge.{Codec, Ref, Tensor}
  alias VllmBridge.Codec.Registry
  alias VllmBridge.TestSupport.Unchecked
  # The generated struct of the Python dataclass (lib/vllm/, `mix vllm.gen.bindings`).
  alias Vllm.ForwardContext.BatchDescriptor

  @vectors_file Path.expand("../../priv/protocol/vectors.txt", __DIR__)
  @external_resource @vectors_file

  # -0.0 built from its bits, so no compiler folding can touch its sign.
  <<neg_zero::float-64>> = <<0x8000000000000000::64>>
  @neg_zero neg_zero

  defp f32(xs), do: for(x <- xs, into: <<>>, do: <<x::little-float-32>>)
  defp i64(xs), do: for(x <- xs, into: <<>>, do: <<x::little-signed-64>>)

  # name => {value, :both} or {value, {:decode_only, why}}
  defp table do
    %{
      "nil" => {nil, :both},
      "true" => {true, :both},
      "false" => {false, :both},
      "int_0" => {0, :both},
      "int_127" => {127, :both},
      "int_128" => {128, :both},
      "int_255" => {255, :both},
      "int_256" => {256, :both},
      "int_65535" => {65_535, :both},
      "int_65536" => {65_536, :both},
      "int_u32_max" => {0xFFFFFFFF, :both},
      "int_2_32" => {0x100000000, :both},
      "int_i64_max" => {0x7FFFFFFFFFFFFFFF, :both},
      "int_u64_max" => {0xFFFFFFFFFFFFFFFF, :both},
      "int_neg_1" => {-1, :both},
      "int_neg_32" => {-32, :both},
      "int_neg_33" => {-33, :both},
      "int_neg_128" => {-128, :both},
      "int_neg_129" => {-129, :both},
      "int_neg_32768" => {-32_768, :both},
      "int_neg_32769" => {-32_769, :both},
      "int_i64_min" => {-0x8000000000000000, :both},
      "bigint_2_64" => {0x10000000000000000, :both},
      "bigint_neg_2_64_minus_1" => {-0x10000000000000001, :both},
      "bigint_2_100" => {Integer.pow(2, 100), :both},
      "float_1_5" => {1.5, :both},
      "float_neg_zero" => {@neg_zero, :both},
      "float_pi" => {3.141592653589793, :both},
      "float_nan" => {:nan, :both},
      "float_inf" => {:infinity, :both},
      "float_neg_inf" => {:neg_infinity, :both},
      "str_empty" => {"", :both},
      "str_utf8" => {"héllo ✓", :both},
      "str_32" => {String.duplicate("a", 32), :both},
      "bin_bytes" => {<<0, 255, 128>>, :both},
      "array_empty" => {[], :both},
      "array_mixed" => {[1, "two", nil, 3.0, [true]], :both},
      "map_empty" => {%{}, :both},
      "map_nested" => {%{"a" => 1, "b" => %{"c" => [1, 2]}}, :both},
      "atom_ok" => {:ok, :both},
      "atom_full" => {:full, :both},
      "tuple_pair" => {{1, "a"}, :both},
      "tuple_empty" => {{}, :both},
      "map_atom_keys" => {%{num_tokens: 8, uniform: true}, :both},
      "tensor_f32_2x2" =>
        {%Tensor{dtype: :float32, shape: [2, 2], data: f32([1.0, -2.5, 0.0, 3.25])}, :both},
      "tensor_i64_vec" =>
        {%Tensor{dtype: :int64, shape: [3], data: i64([7, -1, Integer.pow(2, 40)])}, :both},
      "tensor_i32_empty_0x3" => {%Tensor{dtype: :int32, shape: [0, 3], data: <<>>}, :both},
      "tensor_bool_scalar" => {%Tensor{dtype: :bool, shape: [], data: <<1>>}, :both},
      "tensor_bf16_vec" =>
        {%Tensor{dtype: :bfloat16, shape: [2], data: <<0x3F80::little-16, 0xC0C0::little-16>>},
         :both},
      "tensor_slot_f32_2x2_e7" =>
        {%Tensor{dtype: :float32, shape: [2, 2], data: f32([0.0, 0.0, 0.0, 0.0])}, {:slot, "e-7"}},
      "tensor_f32_cuda" =>
        {%Tensor{dtype: :float32, shape: [1], data: f32([0.5]), device: "cuda:0"}, :both},
      "dataclass_batch_descriptor" =>
        {%BatchDescriptor{
           num_tokens: 8,
           num_reqs: nil,
           uniform: false,
           has_lora: false,
           num_active_loras: 0
         }, :both},
      "enum_cudagraph_full" =>
        {:full,
         {:decode_only,
          "Elixir has no enum values: ext 5 decodes to the lower-cased member name, and " <>
            "the atom :full encodes as ext 1 (the worker converts it by member name)"}},
      "ref_object" =>
        {%Ref{
           instance: "00112233aabbccdd",
           id: 42,
           session: "s1",
           type: "torch.nn.modules.linear.Linear",
           # Decoded, a reference names this node (not on the wire).
           node: node()
         }, :both},
      "msg_call" =>
        {["call", 7, "s1", 5000, ["m", "vllm_bridge.bridge.diag", "add"], [40, 2], %{}], :both},
      "msg_ok" => {["ok", 7, 42], :both},
      "msg_error" =>
        {[
           "error",
           7,
           %{
             "type" => "python_exception",
             "message" => "boom",
             "python_type" => "ValueError",
             "traceback" => "Traceback",
             "exc_id" => 1
           }
         ],
         {:decode_only,
          "the error map's pairs are in Python's insertion order (type, message, ...), " <>
            "which an Elixir map does not keep: Elixir writes pairs in key order (and " <>
            "never sends an error message)"}},
      "msg_ping" => {["ping", 9], :both},
      "msg_cancel" => {["cancel", 7], :both},
      "refuse_map_int_bool" => {%{1 => "a", true => "b"}, {:refused, "the map keys 1 and true"}},
      "refuse_map_int_float" => {%{1 => :x, 1.0 => :y}, {:refused, "the map keys 1 and 1.0"}},
      "refuse_map_atom_str" => {%{:a => 1, "a" => 2}, {:refused, ~s(the map keys :a and "a")}},
      "refuse_map_tuple_keys" =>
        {%{{1, "a"} => 1, {true, :a} => 2}, {:refused, ~s(the map keys {1, "a"} and {true, :a})}},
      "refuse_map_list_key" => {%{[1] => 2}, {:refused, "the map key [1] is a list"}},
      "refuse_map_map_key" => {%{%{} => 1}, {:refused, "the map key %{} is a map"}},
      "refuse_map_tuple_holding_list" =>
        {%{{1, [2]} => 3}, {:refused, "the map key {1, [2]} holds a list ([2])"}}
    }
  end

  defp vectors do
    for line <- File.read!(@vectors_file) |> String.split("\n"),
        line = String.trim(line),
        line != "" and not String.starts_with?(line, "#") do
      [name, hex] = String.split(line)
      {name, Base.decode16!(hex, case: :mixed)}
    end
  end

  setup_all do
    :ok = Registry.register(BatchDescriptor)
  end

  test "the table covers every vector of the file, and nothing else" do
    names = Enum.map(vectors(), &elem(&1, 0))
    assert length(names) == length(Enum.uniq(names)), "duplicate vector names"
    assert Enum.sort(names) == Enum.sort(Map.keys(table()))
  end

  for {name, _bytes} <-
        File.read!(Path.expand("../../priv/protocol/vectors.txt", __DIR__))
        |> String.split("\n")
        |> Enum.reject(&(String.trim(&1) == "" or String.starts_with?(&1, "#")))
        |> Enum.map(&List.to_tuple(String.split(&1))) do
    test "vector #{name}" do
      name = unquote(name)
      bytes = Map.new(vectors())[name]
      {value, mode} = Map.fetch!(table(), name)

      if match?({:slot, _}, mode),
        do: :ok,
        else: assert(Codec.decode(bytes) == {:ok, value})

      case mode do
        {:slot, slot} ->
          # A tensor in a slot (ext 8): decoding it reads the slot (test/shm/), so its
          # bytes are checked here: the header of `value` and the slot's name.
          %Tensor{dtype: dtype, shape: shape} = value
          assert IO.iodata_to_binary(VllmBridge.Codec.SlotExt.encode(value, slot)) == bytes
          <<0xC7, _len, 8, payload::binary>> = bytes
          assert VllmBridge.Codec.SlotExt.parse(payload) == {dtype, shape, "cpu", slot}

        :both ->
          assert IO.iodata_to_binary(Codec.encode(value)) == bytes

        {:decode_only, why} ->
          assert is_binary(why)
          # Still a faithful round trip, if not the same bytes.
          assert Codec.decode(IO.iodata_to_binary(Codec.encode(value))) == {:ok, value}

        {:refused, why} ->
          # The bytes are this value's encoding; the protocol's encoder refuses to send it.
          assert IO.iodata_to_binary(VllmBridge.Codec.Msgpack.encode(value, Unchecked)) == bytes
          error = assert_raise ArgumentError, fn -> Codec.encode(value) end
          assert Exception.message(error) =~ why
      end
    end
  end

  test "-0.0 keeps its sign bit through decode" do
    {:ok, f} = Codec.decode(Map.new(vectors())["float_neg_zero"])
    assert <<0x8000000000000000::64>> == <<f::float-64>>
  end
end
