defmodule VllmBridge.Codec.ExtTest do
  @moduledoc "Extension types other than tensors and dataclasses: atoms, tuples, enums, refs, bigints."
  use ExUnit.Case, async: true

  alias VllmBridge.{Bytes, Codec, Ref}

  defp bin(term), do: IO.iodata_to_binary(Codec.encode(term))
  defp roundtrip(term), do: Codec.decode(bin(term))
  defp ext(type, payload), do: <<0xC7, byte_size(payload), type, payload::binary>>
  defp ext32(type, payload), do: <<0xC9, byte_size(payload)::32, type, payload::binary>>
  defp body(term), do: IO.iodata_to_binary(VllmBridge.Codec.Msgpack.encode(term))

  describe "atoms (ext 1)" do
    test "round trip, as keys too" do
      for a <- [:ok, :error, :"with space", :é, VllmBridge.Codec, :a@b] do
        assert roundtrip(a) == {:ok, a}
        assert roundtrip(%{a => [a]}) == {:ok, %{a => [a]}}
      end
    end

    test "a name with no existing atom decodes to its string and creates no atom" do
      name = "vllm_bridge_no_such_atom_#{System.unique_integer([:positive])}"
      assert Codec.decode(ext(1, name)) == {:ok, name}
      assert_raise ArgumentError, fn -> String.to_existing_atom(name) end
      long = String.duplicate("z", 300)
      assert Codec.decode(<<0xC8, 300::16, 1, long::binary>>) == {:ok, long}
    end

    test "a name that is not UTF-8 is an error" do
      assert {:error, msg} = Codec.decode(ext(1, <<0xFF, 0xFE>>))
      assert msg =~ "not valid UTF-8"
    end

    test "nil, true and false stay msgpack nil and booleans" do
      assert bin(nil) == <<0xC0>>
      assert bin(true) == <<0xC3>>
    end
  end

  describe "special floats" do
    test "the atoms encode as the exact float 64 bits of the protocol and decode back" do
      assert bin(:nan) == <<0xCB, 0x7FF8000000000000::64>>
      assert bin(:infinity) == <<0xCB, 0x7FF0000000000000::64>>
      assert bin(:neg_infinity) == <<0xCB, 0xFFF0000000000000::64>>
      for a <- [:nan, :infinity, :neg_infinity], do: assert(roundtrip([a]) == {:ok, [a]})
    end
  end

  describe "tuples (ext 2)" do
    test "round trip, nested" do
      for t <- [{}, {1}, {1, "a", :ok}, {{1, {2}}, [{3, 4}], %{{5, 6} => {}}}] do
        assert roundtrip(t) == {:ok, t}
      end
    end

    test "a payload that is not exactly one array is an error" do
      assert {:error, msg} = Codec.decode(ext(2, body(%{"a" => 1})))
      assert msg =~ "not an array"
      assert {:error, msg} = Codec.decode(ext(2, body([1]) <> <<0xC0>>))
      assert msg =~ "trailing"
      assert {:error, _} = Codec.decode(ext(2, <<0x92, 1>>))
    end
  end

  describe "big integers (ext 7)" do
    test "round trip both sides of the 64-bit range, sign and magnitude as specified" do
      for i <- [
            0x10000000000000000,
            -0x8000000000000001,
            -0x10000000000000000,
            Integer.pow(7, 200),
            -Integer.pow(3, 500)
          ] do
        assert roundtrip(i) == {:ok, i}
        assert <<0xC7, n, 7, sign, magnitude::binary>> = bin(i)
        assert n == 1 + byte_size(magnitude)
        assert sign == if(i < 0, do: 1, else: 0)
        assert magnitude == :binary.encode_unsigned(abs(i))
        assert :binary.first(magnitude) != 0
      end
    end

    test "integers in the 64-bit range never use ext 7" do
      for i <- [0xFFFFFFFFFFFFFFFF, -0x8000000000000000],
          do: refute(match?(<<0xC7, _::binary>>, bin(i)))
    end

    # Printing an integer takes time quadratic in its size (a 200 KB one, seconds), and
    # logs and errors print values: an ext 7 is refused past 4 096 magnitude bytes
    # (32 768 bits, more than twice the 4 300 digits Python prints by default).
    test "a magnitude over 4 096 bytes is refused naming its size and the cap, both ways" do
      at_cap = :binary.copy(<<0xFF>>, 4_096)
      assert {:ok, i} = Codec.decode(ext32(7, <<1, at_cap::binary>>))
      assert i == -:binary.decode_unsigned(at_cap)
      assert roundtrip(i) == {:ok, i}

      over = <<0, 1, 0::4_096*8>>
      assert {:error, msg} = Codec.decode(ext32(7, over))
      assert msg =~ "big integer (ext 7) of 4097 magnitude bytes"
      assert msg =~ "over the cap of 4096 bytes"

      assert {:error, msg} =
               Codec.decode(ext32(7, <<0, :binary.copy(<<0xFF>>, 300_000)::binary>>))

      assert msg =~ "of 300000 magnitude bytes"

      e = assert_raise ArgumentError, fn -> Codec.encode(Bitwise.bsl(1, 4_096 * 8)) end
      assert e.message =~ "of 4097 magnitude bytes, over the cap of 4096 bytes"
    end

    test "malformed payloads are errors" do
      assert {:error, msg} = Codec.decode(<<0xD4, 7, 0>>)
      assert msg =~ "big integer"
      assert {:error, _} = Codec.decode(<<0xD5, 7, 2, 1>>)
    end
  end

  describe "enum members (ext 5)" do
    test "decode to the lower-cased existing atom, else the lower-cased string" do
      enum = fn member -> ext(5, body(["vllm_bridge.cudagraph.CUDAGraphMode", member])) end
      assert Codec.decode(enum.("PIECEWISE")) == {:ok, :piecewise}
      name = "NO_SUCH_MEMBER_#{System.unique_integer([:positive])}"
      assert Codec.decode(enum.(name)) == {:ok, String.downcase(name)}
    end

    test "malformed payloads are errors" do
      assert {:error, msg} = Codec.decode(ext(5, body(["C"])))
      assert msg =~ "[class, member]"
      assert {:error, _} = Codec.decode(ext(5, body(["C", 1])))
    end
  end

  describe "references (ext 6)" do
    test "round trip, default session included" do
      for r <- [
            %Ref{instance: "0123456789abcdef", id: 1, session: nil, type: "builtins.object"},
            %Ref{instance: "0123456789abcdef", id: 99_999, session: "s", type: "x.Y"}
          ] do
        # Decoded, a reference names this node (it is not on the wire).
        r = %{r | node: node()}
        assert roundtrip(r) == {:ok, r}
        assert roundtrip({r, [r]}) == {:ok, {r, [r]}}
      end
    end

    test "a ref with a field of the wrong type raises on encode; one on the wire is an error" do
      assert_raise ArgumentError, ~r/wrong type/, fn ->
        Codec.encode(%Ref{instance: "i", id: "1", session: nil, type: "t"})
      end

      assert {:error, msg} = Codec.decode(ext(6, body(["i", "1", nil, "t"])))
      assert msg =~ "[instance, id, session, type]"
    end
  end

  test "VllmBridge.Bytes forces bin for UTF-8 data" do
    assert bin(Bytes.new("abc")) == <<0xC4, 3, "abc">>
    assert roundtrip(%{"b" => Bytes.new("")}) == {:ok, %{"b" => ""}}
    assert_raise ArgumentError, fn -> Codec.encode(%Bytes{data: :x}) end
  end

  test "unknown extension codes are errors naming the code" do
    for type <- [0, 9, 100, -1, -128] do
      assert {:error, msg} = Codec.decode(<<0xD4, type::signed-8, 0>>)
      assert msg == "unknown extension type #{type}"
    end
  end
end
