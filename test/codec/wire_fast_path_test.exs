defmodule VllmBridge.Codec.WireFastPathTest do
  @moduledoc """
  The request side's precomputed pieces give the bytes the codec gives: a frame's head
  (`Wire.kind_bytes/1`, `Wire.uint/1`) against `Codec.encode/1` of the same kind and id,
  and a binding's cached target (`Wire.encode_invoke_binding/3`) against
  `Wire.encode_invoke/3` built fresh, over generated targets, arguments and keyword
  arguments, errors included, first use and later ones.
  """
  use ExUnit.Case, async: true

  import Bitwise

  alias VllmBridge.Call.Wire
  alias VllmBridge.Codec
  alias VllmBridge.TestSupport.TermGen

  @kinds ~w(call get enter exit release stream ping cancel credit) ++ ["other", "", "é"]

  test "a request frame's head is Codec.encode's kind and id, at every id width" do
    seed = :erlang.phash2(make_ref())
    :rand.seed(:exsss, {seed, 19, 2})

    edges = [0, 127, 128, 255, 256, 65_535, 65_536, (1 <<< 32) - 1, 1 <<< 32, (1 <<< 64) - 1]

    for kind <- @kinds, id <- edges ++ for(_ <- 1..50, do: :rand.uniform(1 <<< 64) - 1) do
      fields = [Codec.encode(nil), Codec.encode(TermGen.string([0, 3]))]
      size = IO.iodata_length(fields)
      {:ok, frame, body} = Wire.frame_request(kind, id, fields, size)

      expected =
        IO.iodata_to_binary([
          Codec.Msgpack.enc_array_header(length(fields) + 2),
          Codec.encode(kind),
          Codec.encode(id) | fields
        ])

      assert IO.iodata_to_binary(frame) == <<byte_size(expected)::32, expected::binary>>,
             "seed #{seed}: #{kind} #{id}"

      assert body == byte_size(expected)
      assert Wire.kind_bytes(kind) == IO.iodata_to_binary(Codec.encode(kind))
      assert Wire.uint(id) == IO.iodata_to_binary(Codec.encode(id))

      assert Wire.max_request_size(kind, size, timed: true) ==
               1 + IO.iodata_length(Codec.encode(kind)) + 18 + size
    end

    for i <- [-1, 1 <<< 64, 1 <<< 80],
        do: assert(Wire.uint(i) == IO.iodata_to_binary(Codec.encode(i)))
  end

  defp arg do
    Enum.random([
      fn -> TermGen.integer() end,
      fn -> TermGen.string([0, 4]) end,
      fn -> [1, "a"] end,
      fn -> %{"k" => 1.5} end,
      fn -> self() end,
      fn -> %{[1] => 2} end
    ]).()
  end

  defp kwargs do
    case :rand.uniform(6) do
      1 -> %{}
      2 -> []
      3 -> [a: arg()]
      4 -> %{"b" => arg(), "c" => arg()}
      5 -> [a: 1, a: 2]
      6 -> :not_kwargs
    end
  end

  test "a binding's cached target gives encode_invoke/3's bytes and errors" do
    seed = :erlang.phash2(make_ref())
    :rand.seed(:exsss, {seed, 19, 3})
    modules = ["vllm_bridge.forward_context", "m#{seed}", "é.x"]
    paths = ["is_forward_context_available", "f", "C.method"]

    for _ <- 1..2_000 do
      target = {Enum.random(modules), Enum.random(paths)}
      args = Enum.random([[], [], [arg()], [arg(), arg()], :not_a_list])
      kw = kwargs()

      case {Wire.encode_invoke_binding(target, args, kw), Wire.encode_invoke(target, args, kw)} do
        {{:ok, fast}, {:ok, general}} ->
          assert IO.iodata_to_binary(fast) == IO.iodata_to_binary(general),
                 "seed #{seed}: #{inspect({target, args, kw})}"

          assert IO.iodata_length(fast) == IO.iodata_length(general)

        {fast, general} ->
          assert fast == general, "seed #{seed}: #{inspect({target, args, kw})}"
      end
    end
  end
end
