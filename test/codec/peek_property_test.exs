defmodule VllmBridge.Codec.PeekPropertyTest do
  @moduledoc """
  `VllmBridge.Call.Wire.peek/1` (the kind and id a worker process routes a frame by,
  read from its first bytes) answers exactly as its general path, `peek_general/1` (any
  head, read by hand), and both as a full decode of the frame would, for every
  well-formed frame: generated frames of every kind a worker sends, ids at every msgpack
  integer width and ids that are not ids, values of every kind, shapes of other lengths,
  and the same frames with array 16 and array 32 heads and str 8, 16 and 32 kinds.
  bench/results/fast-paths.md ("Fast paths beside general paths") has what it saves.
  """
  use ExUnit.Case, async: true

  import Bitwise

  alias VllmBridge.Call.Wire
  alias VllmBridge.Codec
  alias VllmBridge.TestSupport.TermGen

  # Ids at each encoding's edges (positive fixint, uint 8/16/32/64), and not-ids.
  @ids [0, 1, 127, 128, 255, 256, 65_535, 65_536, (1 <<< 32) - 1, 1 <<< 32, (1 <<< 64) - 1] ++
         [-1, -32, -33, -200, -70_000, nil, "7", 1.5, true, [1]]

  defp value do
    TermGen.nested(Enum.random(0..3),
      leaf: fn ->
        Enum.random([
          fn -> TermGen.integer() end,
          fn -> TermGen.float() end,
          fn -> TermGen.string([0, 1, 40]) end,
          fn -> TermGen.bytes([0, 5]) end,
          fn -> TermGen.tensor(2, 3) end,
          fn -> Enum.random([nil, true, false, :nan, :an_atom]) end
        ]).()
      end,
      key: fn -> TermGen.string([1, 5]) end
    )
  end

  defp frame do
    id = Enum.random(@ids)

    term =
      case :rand.uniform(12) do
        n when n <= 4 ->
          [Enum.random(["ok", "chunk", "pong"]), id, value()]

        5 ->
          ["error", id, %{"type" => "python_exception", "message" => TermGen.string([3])}]

        6 ->
          ["end", id]

        7 ->
          ["log", Enum.random(["warning", "error"]), "a.logger", TermGen.string([0, 20])]

        8 ->
          ["hello", %{"protocol" => 1, "pid" => id, "instance" => "00"}]

        # Other lengths of the same kinds, other kinds, not a list.
        9 ->
          [
            Enum.random(["ok", "end", "log", "hello", "chunk"])
            | for(_ <- 1..Enum.random(0..4)//1, do: id)
          ]

        10 ->
          [Enum.random(["okay", "", "OK", "ping"]), id, value()]

        11 ->
          [id, "ok", value()]

        12 ->
          value()
      end

    IO.iodata_to_binary(Codec.encode(term))
  end

  # What a full decode says the kind and id are (what the worker process must not do).
  @kinds %{"ok" => :ok, "error" => :error, "chunk" => :chunk, "end" => :end, "pong" => :pong}

  defp decoded_head(bin) do
    case Codec.decode(bin) do
      {:ok, [kind | _]} when kind in ["log", "hello"] ->
        {String.to_existing_atom(kind), nil}

      {:ok, [kind | rest]} when is_map_key(@kinds, kind) ->
        case rest do
          [id | _] when is_integer(id) and id >= 0 -> {@kinds[kind], id}
          _ -> {@kinds[kind], nil}
        end

      _ ->
        {:unknown, nil}
    end
  end

  # The same frame with its array header (when it is a fixarray) and its first element's
  # header (when it is a fixstr) in a longer form that msgpack also allows.
  defp widened(<<0b1001::4, n::4, rest::binary>>) do
    array = Enum.random([<<0x90 + n>>, <<0xDC, n::16>>, <<0xDD, n::32>>])

    rest =
      case rest do
        <<0b101::3, len::5, s::binary-size(len), tail::binary>> ->
          str = Enum.random([<<0xA0 + len>>, <<0xD9, len>>, <<0xDA, len::16>>, <<0xDB, len::32>>])
          <<str::binary, s::binary, tail::binary>>

        _ ->
          rest
      end

    <<array::binary, rest::binary>>
  end

  defp widened(bin), do: bin

  test "peek/1 answers as peek_general/1 and as a full decode for 5 000 generated frames" do
    seed = :erlang.phash2(make_ref())
    :rand.seed(:exsss, {seed, 14, 6})

    heads =
      for _ <- 1..5_000 do
        bin = frame()

        for b <- [bin, widened(bin)] do
          assert Wire.peek(b) == Wire.peek_general(b), "seed #{seed}: #{inspect(b, limit: 40)}"
          assert Wire.peek(b) == decoded_head(b), "seed #{seed}: #{inspect(b, limit: 40)}"
        end

        Wire.peek(bin)
      end

    # Every kind was drawn with a routable id, and frames that are not replies too.
    for kind <- [:ok, :error, :chunk, :end, :pong],
        do: assert(Enum.any?(heads, &match?({^kind, id} when is_integer(id), &1)), "#{kind}")

    for head <- [{:log, nil}, {:hello, nil}, {:unknown, nil}], do: assert(head in heads)
  end

  test "a frame whose head is well-formed but whose tail is not is read by its head" do
    # Neither path reads further (the caller decoding it gets :protocol); a full decode
    # cannot read it at all.
    bin = IO.iodata_to_binary(Codec.encode(["ok", 300, "a value"]))
    truncated = binary_part(bin, 0, byte_size(bin) - 1)
    assert Wire.peek(truncated) == {:ok, 300}
    assert Wire.peek_general(truncated) == {:ok, 300}
    <<0x93, rest::binary>> = truncated
    assert Wire.peek(<<0xDC, 3::16, rest::binary>>) == {:ok, 300}
    assert decoded_head(truncated) == {:unknown, nil}
  end
end
