defmodule VllmBridge.CodecTest.Point do
  @moduledoc false
  defstruct x: 0, y: 0, label: "origin"
  def __python_class__, do: "tests.geometry.Point"
  # Python declaration order, not alphabetical
  def __python_fields__, do: [:y, :x, :label]
end

defmodule VllmBridge.CodecTest.Late do
  @moduledoc false
  defstruct [:a]
  def __python_class__, do: "tests.late.Late"
  def __python_fields__, do: [:a]
end

defmodule VllmBridge.CodecTest.Loaded do
  @moduledoc false
  defstruct [:b]
  def __python_class__, do: "tests.loaded.Loaded"
  def __python_fields__, do: [:b]
end

defmodule VllmBridge.CodecTest.BadFields do
  @moduledoc false
  defstruct [:a]
  def __python_class__, do: "tests.bad.BadFields"
  def __python_fields__, do: [:a, :not_a_field]
end

defmodule VllmBridge.CodecTest.Plain do
  @moduledoc false
  defstruct [:a]
end

defmodule VllmBridge.Codec.DataclassTest do
  @moduledoc "Structs for Python dataclasses (ext 4), VllmBridge.Object and the registry."
  use ExUnit.Case, async: true

  alias VllmBridge.{Codec, Object}
  alias VllmBridge.Codec.{Msgpack, Registry}
  alias VllmBridge.CodecTest.{BadFields, Late, Loaded, Plain, Point}

  defp bin(term), do: IO.iodata_to_binary(Codec.encode(term))
  defp ext4(class, pairs), do: Msgpack.enc_ext(4, [0x92, Msgpack.enc_str(class), pairs])

  # A map body with its pairs in the given order.
  defp ordered_map(pairs) do
    [0x80 + length(pairs) | for({k, v} <- pairs, do: [Msgpack.enc_str(k) | Codec.encode(v)])]
  end

  setup_all do
    :ok = Registry.register(Point)
  end

  test "a struct encodes its fields in Python declaration order" do
    p = %Point{x: 1, y: 2, label: "p"}
    expected = ext4("tests.geometry.Point", ordered_map([{"y", 2}, {"x", 1}, {"label", "p"}]))
    assert bin(p) == IO.iodata_to_binary(expected)
    assert Codec.decode(bin(p)) == {:ok, p}
    assert Codec.decode(bin(%{"pts" => [p, {p}]})) == {:ok, %{"pts" => [p, {p}]}}
  end

  test "a registered class decodes to its struct; a field not sent keeps its default" do
    body = IO.iodata_to_binary(ext4("tests.geometry.Point", ordered_map([{"x", 5}])))
    assert Codec.decode(body) == {:ok, %Point{x: 5, y: 0, label: "origin"}}
  end

  test "a field the struct does not declare is a decode error naming it" do
    body = IO.iodata_to_binary(ext4("tests.geometry.Point", ordered_map([{"z", 5}])))
    assert {:error, msg} = Codec.decode(body)
    assert msg =~ ~s(tests.geometry.Point has no field "z")
  end

  test "an unknown class decodes to an Object that encodes back to the same bytes" do
    body =
      IO.iodata_to_binary(
        ext4("some.module.Thing", ordered_map([{"zeta", 1}, {"alpha", [:ok]}, {"mid", nil}]))
      )

    assert {:ok, %Object{} = o} = Codec.decode(body)
    assert o.class == "some.module.Thing"
    assert o.fields == %{"zeta" => 1, "alpha" => [:ok], "mid" => nil}
    assert o.field_order == ["zeta", "alpha", "mid"]
    assert bin(o) == body
  end

  test "an Object built by hand writes listed fields first, then the rest by name" do
    o = %Object{class: "m.C", fields: %{"b" => 1, "a" => 2, "c" => 3}, field_order: ["c"]}
    assert bin(o) == IO.iodata_to_binary(ext4("m.C", ordered_map([{"c", 3}, {"a", 2}, {"b", 1}])))

    assert_raise ArgumentError, ~r/class must be a string/, fn ->
      Codec.encode(%Object{class: :c})
    end
  end

  test "register/1 makes a module loaded later decodable" do
    late = %Late{a: {1, 2}}
    body = bin(late)
    # encodable before registration (read from the module itself) ...
    assert {:ok, %Object{class: "tests.late.Late", fields: %{"a" => {1, 2}}}} = Codec.decode(body)

    # ... and decoded to the struct after it
    assert :ok = Registry.register(Late)
    assert {:ok, ^late} = Codec.decode(body)
    assert Registry.lookup("tests.late.Late") |> elem(1) |> Map.fetch!(:module) == Late
    assert Registry.registered()["tests.late.Late"] == Late
  end

  test "register/1 refuses modules that do not describe a Python dataclass struct" do
    assert_raise ArgumentError, ~r/VllmBridge.CodecTest.Plain is not a struct module/, fn ->
      Registry.register(Plain)
    end

    assert_raise ArgumentError, ~r/:not_a_field/, fn -> Registry.register(BadFields) end
    assert_raise ArgumentError, ~r/NoSuchModule/, fn -> Registry.register(NoSuchModule) end
  end

  test "a struct without a Python class cannot be encoded" do
    e = assert_raise ArgumentError, fn -> Codec.encode(%Plain{a: 1}) end
    assert e.message =~ "%VllmBridge.CodecTest.Plain{a: 1}"
    assert e.message =~ "declares no Python class"
  end

  test "load/1 registers the modules of an application that declare a Python class" do
    app = :vllm_bridge_codec_test_app
    spec = [description: 'test', vsn: '0', modules: [Plain, BadFields, Point, Loaded]]
    :ok = :application.load({:application, app, spec})
    on_exit(fn -> :application.unload(app) end)

    log = ExUnit.CaptureLog.capture_log(fn -> assert Registry.load(app) == 2 end)
    assert log =~ "BadFields" and log =~ ":not_a_field"
    assert Registry.registered()["tests.loaded.Loaded"] == Loaded
    assert Codec.decode(bin(%Loaded{b: 1})) == {:ok, %Loaded{b: 1}}
    refute Map.has_key?(Registry.registered(), "tests.bad.BadFields")
    assert Registry.load(:no_such_app) == 0
  end

  test "malformed payloads are errors" do
    for {payload, msg} <- [
          {IO.iodata_to_binary(Msgpack.encode(["C"])), "array of 1, not 2"},
          {IO.iodata_to_binary(Msgpack.encode([1, %{}])), "class name is not a string"},
          {IO.iodata_to_binary(Msgpack.encode(["C", [1]])), "expected a map"},
          {IO.iodata_to_binary(Msgpack.encode(["C", %{1 => 2}])), "field name is not a string"},
          {IO.iodata_to_binary(Msgpack.encode(["C", %{}])) <> <<0>>, "trailing bytes"},
          {<<0x92, 0xA1, "C", 0x82, 0xA1, "a", 1, 0xA1, "a", 2>>, "dataclass C repeats a field"},
          {<<0x92, 0xA1, "C", 0x82, 0xA1, "a", 1>>, "ended"}
        ] do
      assert {:error, reason} = Codec.decode(IO.iodata_to_binary(Msgpack.enc_ext(4, payload)))
      assert reason =~ msg
    end
  end
end
