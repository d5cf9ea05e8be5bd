defmodule VllmBridge.Codec.PeekPropertyTest do
  @moduledoc """
  `VllmBridge.Call.Wire.peek/1` (the kind and id a worker process routes a frame by,
  read from its first bytes) answers exactly as its general path, `peek_general/1` (a
  full decode), for every well-formed frame: generated frames of every kind a worker
  sends, ids at every msgpack integer width and ids that are not ids, values of every
  kind, and shapes of other lengths. bench/results/fast-paths.md ("Fast paths beside
  general paths") has what it saves.
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

  test "peek/1 answers as peek_general/1 for 5 000 generated frames" do
    seed = :erlang.phash2(make_ref())
    :rand.seed(:exsss, {seed, 14, 6})

    heads =
      for _ <- 1..5_000 do
        bin = frame()

        assert Wire.peek(bin) == Wire.peek_general(bin),
               "seed #{seed}: #{inspect(bin, limit: 40)}"

        Wire.peek(bin)
      end

    # Every kind was drawn with a routable id, and frames that are not replies too.
    for kind <- [:ok, :error, :chunk, :end, :pong],
        do: assert(Enum.any?(heads, &match?({^kind, id} when is_integer(id), &1)), "#{kind}")

    for head <- [{:log, nil}, {:hello, nil}, {:unknown, nil}], do: assert(head in heads)
  end

  test "a frame whose head is well-formed but whose tail is not is read by its head" do
    # The fast path reads no further (the caller decoding it gets :protocol); the general
    # path, a full decode, cannot read it at all.
    bin = IO.iodata_to_binary(Codec.encode(["ok", 300, "a value"]))
    truncated = binary_part(bin, 0, byte_size(bin) - 1)
    assert Wire.peek(truncated) == {:ok, 300}
    assert Wire.peek_general(truncated) == {:unknown, nil}
  end
end
