defmodule VllmBridge.Codec.ReplyFastPathTest do
  @moduledoc """
  `VllmBridge.Call.Wire.decode_reply/1` reads an `ok` reply whose value is a scalar by
  pattern; it answers exactly as its general path, `decode_reply_general/1` (a full
  decode), for every reply: generated `ok` replies with ids at every msgpack width and
  scalars of every encoding (and the specials, containers and other kinds the fast path
  leaves to the general one), and the same frames cut short or with bytes added.
  bench/results/erlport-round-trip.md ("What changed, measured") has what it saves.
  """
  use ExUnit.Case, async: true

  import Bitwise

  alias VllmBridge.Call.Wire
  alias VllmBridge.Codec
  alias VllmBridge.TestSupport.TermGen

  @ids [0, 1, 127, 128, 255, 256, 65_535, 65_536, (1 <<< 32) - 1, 1 <<< 32, (1 <<< 64) - 1] ++
         [-1, -33, nil, "7", 1.5]

  # Scalars at the edges of each encoding, and values the fast path does not read.
  defp value do
    case :rand.uniform(10) do
      1 -> Enum.random([nil, true, false])
      2 -> Enum.random([0, 1, 127, 128, 255, 256, 65_535, 65_536, -1, -32, -33, -128, -129])
      3 -> Enum.random([-32_768, -32_769, (1 <<< 32) - 1, 1 <<< 32, -(1 <<< 31) - 1, -(1 <<< 63)])
      4 -> TermGen.integer()
      5 -> Enum.random([TermGen.float(), 0.0, -0.0, :nan, :infinity, :neg_infinity])
      6 -> TermGen.string([0, 1, 31, 32, 40, 300])
      7 -> TermGen.bytes([0, 5])
      8 -> Enum.random([[], [1], %{}, %{"a" => 1}, {1, 2}, :an_atom])
      9 -> TermGen.tensor(1, 3)
      10 -> Enum.random([1 <<< 64, -(1 <<< 64), 1 <<< 100])
    end
  end

  defp reply do
    term =
      case :rand.uniform(8) do
        n when n <= 5 -> ["ok", Enum.random(@ids), value()]
        6 -> [Enum.random(["chunk", "pong", "okay"]), Enum.random(@ids), value()]
        7 -> ["error", 5, %{"type" => "python_exception", "message" => TermGen.string([3])}]
        8 -> ["ok", Enum.random(@ids) | for(_ <- 1..Enum.random(0..2)//1, do: value())]
      end

    bin = IO.iodata_to_binary(Codec.encode(term))

    case :rand.uniform(6) do
      1 -> binary_part(bin, 0, :rand.uniform(byte_size(bin)) - 1)
      2 -> bin <> :rand.bytes(:rand.uniform(3))
      _ -> bin
    end
  end

  test "decode_reply/1 answers as decode_reply_general/1 for 20 000 generated replies" do
    seed = :erlang.phash2(make_ref())
    :rand.seed(:exsss, {seed, 19, 1})

    fast =
      for _ <- 1..20_000, reduce: 0 do
        n ->
          bin = reply()

          assert Wire.decode_reply(bin) == Wire.decode_reply_general(bin),
                 "seed #{seed}: #{inspect(bin, limit: 40)}"

          if match?({:ok, v} when not is_list(v) and not is_map(v), Wire.decode_reply(bin)),
            do: n + 1,
            else: n
      end

    # The fast path's shapes were drawn (not only the general path's).
    assert fast > 1_000
  end

  test "str 8 and str of 32 bytes and more are read by the fast path too" do
    for s <- [
          "",
          "é",
          String.duplicate("a", 31),
          String.duplicate("b", 32),
          String.duplicate("c", 255)
        ] do
      bin = IO.iodata_to_binary(Codec.encode(["ok", 1 <<< 40, s]))
      assert Wire.decode_reply(bin) == {:ok, s}
      assert Wire.decode_reply_general(bin) == {:ok, s}
    end
  end
end
