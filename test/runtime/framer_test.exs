defmodule VllmBridge.Runtime.FramerTest do
  @moduledoc """
  `VllmBridge.Worker.Framer` on seeded random streams: frames of random sizes (empty,
  small, around 64 KiB, larger), cut at random points (single bytes, headers split, many
  frames in one chunk, a body over many chunks), come out whole and in order; one whole
  frame in one chunk comes out as it does among others, and `whole/3` (the worker
  process's one step for it) answers as `feed/3`; a header over the limit is refused
  wherever the cut falls, with the whole frames before it, and nothing after the header
  is kept.
  """
  use ExUnit.Case, async: true

  import Bitwise, only: [<<<: 2]

  alias VllmBridge.Worker.Framer

  @seeds [1, 2, 3, 17, 4242]
  @max 300_000

  defp frame(body), do: <<byte_size(body)::32, body::binary>>

  defp body do
    size =
      case :rand.uniform(10) do
        1 -> 0
        n when n <= 5 -> :rand.uniform(100)
        n when n <= 8 -> 65_530 + :rand.uniform(12)
        _ -> :rand.uniform(250_000)
      end

    :rand.bytes(size)
  end

  # Cuts `bin` into chunks of random sizes (1 byte to a little over 64 KiB).
  defp cut(<<>>, acc), do: Enum.reverse(acc)

  defp cut(bin, acc) do
    n =
      case :rand.uniform(4) do
        1 -> :rand.uniform(5)
        2 -> :rand.uniform(200)
        _ -> :rand.uniform(70_000)
      end

    n = min(n, byte_size(bin))
    <<chunk::binary-size(n), rest::binary>> = bin
    cut(rest, [chunk | acc])
  end

  defp feed_all(chunks, max) do
    Enum.reduce_while(chunks, {[], Framer.new()}, fn chunk, {out, st} ->
      case Framer.feed(st, chunk, max) do
        {:ok, frames, st} -> {:cont, {out ++ frames, st}}
        {:too_large, len, frames} -> {:halt, {:too_large, len, out ++ frames}}
      end
    end)
  end

  test "random frames cut at random points come out whole and in order" do
    for seed <- @seeds do
      :rand.seed(:exsss, {seed, seed, seed})
      bodies = for _ <- 1..60, do: body()
      stream = IO.iodata_to_binary(Enum.map(bodies, &frame/1))

      for _ <- 1..5 do
        assert {out, state} = feed_all(cut(stream, []), @max)
        assert state == Framer.new(), "seed #{seed}: bytes left over"
        assert out == bodies, "seed #{seed}"
      end

      # All in one chunk; and one byte at a time (over small frames: it is slow).
      assert {^bodies, <<>>} = feed_all([stream], @max)
      small = Enum.filter(bodies, &(byte_size(&1) <= 100))
      bytes = IO.iodata_to_binary(Enum.map(small, &frame/1))
      assert {^small, <<>>} = feed_all(for(<<b <- bytes>>, do: <<b>>), @max)
    end
  end

  test "one whole frame in one chunk comes out as behind another frame or after a split header" do
    for seed <- @seeds do
      :rand.seed(:exsss, {seed, seed, seed})

      for _ <- 1..50 do
        b = body()
        assert {:ok, [^b], <<>>} = Framer.feed(<<>>, frame(b), @max)
        # The general path: the same frame behind an empty one, or after a split header.
        assert {:ok, [<<>>, ^b], <<>>} = Framer.feed(<<>>, frame(<<>>) <> frame(b), @max)
        <<h::binary-size(2), rest::binary>> = frame(b)
        assert {:ok, [], st} = Framer.feed(<<>>, h, @max)
        assert {:ok, [^b], <<>>} = Framer.feed(st, rest, @max)
      end
    end
  end

  # Framer.whole/3, the worker process's one step for a chunk that is one whole frame:
  # on generated states (between frames, part of a header, a body in progress) and
  # chunks (one frame, several, a frame and a part, a part, a header over the limit, the
  # limit itself), wherever it gives a body, feed/3 gives exactly that body and the
  # state between frames; where it gives nil, feed/3 is taken and is not that case.
  test "whole/3 answers as feed/3 wherever it takes the chunk, and only there" do
    for seed <- @seeds do
      :rand.seed(:exsss, {seed, seed, seed})

      for _ <- 1..300 do
        max = Enum.random([0, 1, 100, 70_000, @max])
        state = Enum.random([Framer.new(), <<0, 0>>, {:body, 5, ["abc"]}])
        b = body()

        chunk =
          case :rand.uniform(6) do
            1 -> frame(b)
            2 -> frame(b) <> frame(<<>>)
            3 -> frame(b) <> <<0, 0>>
            4 -> binary_part(frame(b), 0, :rand.uniform(byte_size(b) + 4) - 1)
            5 -> frame(:binary.copy("x", min(max, 2000)))
            6 -> <<byte_size(b) + 1::32>> <> b
          end

        case Framer.whole(state, chunk, max) do
          nil ->
            refute match?({:ok, [_], <<>>}, Framer.feed(state, chunk, max)) and
                     state == Framer.new() and
                     chunk == frame(hd(elem(Framer.feed(state, chunk, max), 1)))

          body ->
            assert Framer.feed(state, chunk, max) == {:ok, [body], Framer.new()}
        end
      end
    end
  end

  test "a body exactly at the limit passes; one byte more is refused at its header" do
    at = :binary.copy("a", 1000)
    assert {:ok, [^at], <<>>} = Framer.feed(<<>>, frame(at), 1000)
    assert {:too_large, 1001, []} = Framer.feed(<<>>, frame(at <> "b"), 1000)
  end

  test "a header over the limit is refused wherever the stream is cut, after the frames before it" do
    for seed <- @seeds do
      :rand.seed(:exsss, {seed, seed, seed})
      before = for _ <- 1..5, do: body()
      declared = Enum.random([@max + 1, 1 <<< 31, 0xFFFF_FFFF])
      # The header, then bytes that would be its body (and a ping behind it).
      stream =
        IO.iodata_to_binary([Enum.map(before, &frame/1), <<declared::32>>, :rand.bytes(5_000)])

      for _ <- 1..10 do
        assert {:too_large, ^declared, ^before} = feed_all(cut(stream, []), @max)
      end
    end
  end

  test "a body in progress keeps only the bytes that arrived" do
    declared = 200_000

    st =
      Enum.reduce(1..3, Framer.new(), fn
        1, st ->
          elem(Framer.feed(st, <<declared::32, :binary.copy(<<0>>, 10_000)::binary>>, @max), 2)

        _, st ->
          elem(Framer.feed(st, :binary.copy(<<0>>, 10_000), @max), 2)
      end)

    assert {:body, missing, chunks} = st
    assert missing == declared - 30_000
    assert chunks |> Enum.map(&byte_size/1) |> Enum.sum() == 30_000
  end
end
