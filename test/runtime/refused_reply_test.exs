defmodule VllmBridge.Runtime.RefusedReplyTest do
  @moduledoc """
  A reply the caller refuses partway through its decode (a result slot over the reply
  limit, a big integer over its cap, an unknown extension, a malformed reference, bytes
  that are not msgpack, a reply of the wrong shape) gives back what it holds: every
  result slot it names is handed back (renamed `.free`) and every reference it carries
  is released to the worker (a `release` request, in its session), each once, whether
  it sits before or after the refused value, at any depth; the caller gets the same
  error as before. Where the frame stops being msgpack, what comes after cannot be
  found: what comes before still goes back.

  Generated replies go through the caller's decode (`Wire.decode_reply/3`) with real
  slot files, this process standing for the worker process (the releases come here);
  then replies a real worker sends, its held references and its lent slots counted.
  Not async: it uses the node's slot directory and this process's reply limit.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Codec, Error, Ref, Session, Shm, Worker}
  alias VllmBridge.Call.Wire
  alias VllmBridge.Codec.{Msgpack, SlotExt}
  alias VllmBridge.Worker.Unclaimed
  alias VllmBridge.Worker.Messages.Submit

  # The reply limit the decodes below are given, as a worker's comes with its replies: a
  # slot of @over bytes is refused, the generated ones (16 bytes) are not.
  @limit 1_048_576
  @over 2_097_152
  @instance "0123456789abcdef"

  setup do
    seed = :rand.uniform(1_000_000_000)
    :rand.seed(:exsss, {seed, 23, 11})
    %{path: dir} = Shm.dir()
    %{seed: seed, dir: dir}
  end

  # -- generated frames ----------------------------------------------------------------

  # Where the replies come from: this BEAM's os pid stands as the worker's Python
  # process (the slots of this test are named for it).
  defp origin, do: {@limit, String.to_integer(System.pid())}

  # A slot of this test: a 16-byte file in the directory, named as a worker's result.
  defp new_slot(dir) do
    name = "r-#{System.pid()}-#{System.unique_integer([:positive])}"
    path = Path.join(dir, name)
    File.write!(path, :binary.copy(<<7>>, 16))
    on_exit(fn -> for p <- [path, path <> ".free"], do: File.rm(p) end)
    {:slot, name, [16]}
  end

  defp new_ref do
    %Ref{
      instance: @instance,
      id: System.unique_integer([:positive]),
      session: Enum.random([nil, "s-1", "s-2"]),
      type: "mod.T"
    }
  end

  defp item(dir) do
    case :rand.uniform(5) do
      n when n <= 2 -> new_slot(dir)
      n when n <= 4 -> {:ref, new_ref()}
      5 -> {:int, :rand.uniform(1_000_000)}
    end
  end

  # {the raw bytes, what the error says, whether the frame is msgpack after it}
  defp refuser(dir) do
    case :rand.uniform(5) do
      1 ->
        {<<0xC9, 4098::32, 7, 0, :binary.copy(<<1>>, 4097)::binary>>,
         ~r/big integer \(ext 7\) of 4097 magnitude bytes is over the cap/, true}

      2 ->
        {<<0xD4, 99, 0>>, ~r/unknown extension type 99/, true}

      3 ->
        {:slot, name, _} = new_slot(dir)

        {slot_bytes(name, [@over]), ~r/"#{name}" \(ext 8\).*over the reply limit of #{@limit}/,
         true}

      4 ->
        {IO.iodata_to_binary(Msgpack.ext_header(6, 2)) <> <<0x91, 1>>,
         ~r/a reference \(ext 6\) payload must be/, true}

      5 ->
        {<<0xC1>>, ~r/reserved type byte 0xC1/, false}
    end
  end

  defp slot_bytes(name, shape) do
    payload = SlotExt.payload(:uint8, shape, "", name)
    IO.iodata_to_binary([Msgpack.ext_header(8, byte_size(payload)), payload])
  end

  # The items nested at random: runs of them become lists, maps, tuples (ext 2) or
  # dataclasses (ext 4), in frame order.
  defp nest(items, 0), do: items

  defp nest(items, depth) do
    items
    |> Enum.chunk_while([], &run/2, &{:cont, Enum.reverse(&1), []})
    |> Enum.flat_map(fn
      [one] ->
        [one]

      run ->
        if :rand.uniform(4) == 1,
          do: run,
          else: [{Enum.random([:list, :map, :tuple, :dataclass]), nest(run, depth - 1)}]
    end)
  end

  defp run(x, acc) do
    if acc != [] and :rand.uniform(3) == 1,
      do: {:cont, Enum.reverse(acc), [x]},
      else: {:cont, [x | acc]}
  end

  defp enc({:slot, name, shape}), do: slot_bytes(name, shape)
  defp enc({:ref, ref}), do: Codec.encode(ref)
  defp enc({:int, i}), do: Codec.encode(i)
  defp enc({:raw, bin}), do: bin
  defp enc({:list, xs}), do: [Msgpack.enc_array_header(length(xs)) | Enum.map(xs, &enc/1)]

  defp enc({:map, xs}) do
    pairs = for {x, i} <- Enum.with_index(xs), do: [Msgpack.enc_str("k#{i}"), enc(x)]
    [Msgpack.enc_map_header(length(xs)) | pairs]
  end

  defp enc({:tuple, xs}), do: Msgpack.enc_ext(2, enc({:list, xs}))

  defp enc({:dataclass, xs}),
    do: Msgpack.enc_ext(4, [0x92, Msgpack.enc_str("mod.Class"), enc({:map, xs})])

  defp frame(items, extra \\ []) do
    value = {:list, nest(items, Enum.random(0..5))}
    head = [Msgpack.enc_array_header(3 + length(extra)), Msgpack.enc_str("ok"), 9]
    IO.iodata_to_binary([head, enc(value) | Enum.map(extra, &enc/1)])
  end

  # -- what came back ------------------------------------------------------------------

  defp names(items), do: for({:slot, name, _} <- items, uniq: true, do: name)
  defp refs(items), do: for({:ref, ref} <- items, uniq: true, do: key(ref))
  defp key(%Ref{instance: i, id: id, session: s}), do: {i, id, s}

  defp freed?(dir, name),
    do: File.exists?(Path.join(dir, name <> ".free")) and not File.exists?(Path.join(dir, name))

  # The release requests sent to this process (standing for the worker process): each
  # one's session and references.
  defp releases(acc \\ []) do
    receive do
      {:"$vb_req", %Submit{frame: frame}} ->
        <<_size::32, body::binary>> = IO.iodata_to_binary(frame)
        {:ok, ["release", _id, session, refs]} = Codec.decode(body)
        releases([{session, refs} | acc])
    after
      0 -> Enum.reverse(acc)
    end
  end

  defp released(releases) do
    for {session, refs} <- releases, %Ref{} = ref <- refs do
      assert ref.session == session, "released in another session: #{inspect(ref)}"
      key(ref)
    end
  end

  describe "a generated reply refused partway" do
    test "hands back every slot and releases every reference it holds, each once",
         %{seed: seed, dir: dir} do
      for round <- 1..300 do
        before = for _ <- 1..Enum.random(0..6)//1, do: item(dir)
        later = for _ <- 1..Enum.random(1..6)//1, do: item(dir)
        # At least a slot and a reference after the refused value, and now and then the
        # same one twice (the slot is read at most once; the reference released once).
        later = [new_slot(dir), {:ref, new_ref()} | later]
        again = Enum.take_random(before ++ later, Enum.random(0..2))
        later = Enum.shuffle(later ++ again)
        {bad, says, walkable} = refuser(dir)
        items = before ++ [{:raw, bad}] ++ later
        bin = frame(items)
        why = "seed #{seed}, round #{round}: #{inspect(items, limit: 40)}"

        assert {:error, %Error{type: :protocol, message: msg}} =
                 Wire.decode_reply(bin, origin(), self()),
               why

        assert msg =~ says, why

        # What the caller can still find: all of it; or (bytes that are not msgpack) what
        # comes before them, and what follows the extension payload they are in, if any.
        reach = if walkable, do: items, else: before
        for name <- names(reach), do: assert(freed?(dir, name), "#{name} lent; #{why}")
        released = released(releases())
        assert Enum.uniq(released) == released, "released twice; #{why}"

        if walkable,
          do: assert(Enum.sort(released) == Enum.sort(refs(items)), why),
          else: assert(refs(before) -- released == [] and released -- refs(items) == [], why)
      end
    end

    test "a reply of the wrong shape gives back what it holds", %{seed: seed, dir: dir} do
      for round <- 1..50 do
        items = for _ <- 1..Enum.random(1..8), do: item(dir)
        extra = for _ <- 1..Enum.random(1..3), do: item(dir)
        why = "seed #{seed}, round #{round}"

        assert {:error, %Error{type: :protocol, message: "unexpected reply" <> _}} =
                 Wire.decode_reply(frame(items, extra), origin(), self()),
               why

        for name <- names(items ++ extra), do: assert(freed?(dir, name), why)
        assert Enum.sort(released(releases())) == Enum.sort(refs(items ++ extra)), why
      end
    end

    test "an error reply without its error map gives back what it holds", %{dir: dir} do
      items = [{:ref, new_ref()}, new_slot(dir), {:ref, new_ref()}]
      bin = frame(items) |> String.replace_prefix(<<0x93, 0xA2, "ok">>, <<0x93, 0xA5, "error">>)

      assert {:error,
              %Error{type: :protocol, message: "the worker answered a malformed error map" <> _}} =
               Wire.decode_reply(bin, origin(), self())

      for name <- names(items), do: assert(freed?(dir, name))
      assert Enum.sort(released(releases())) == Enum.sort(refs(items))
    end

    test "a refused reply nobody reads releases its references (the worker process drops it)",
         %{dir: dir} do
      items = [{:ref, new_ref()}, {:raw, <<0xD4, 99, 0>>}, new_slot(dir), {:ref, new_ref()}]
      assert :ok = Unclaimed.drop(frame(items), origin())
      assert Enum.sort(released(releases())) == Enum.sort(refs(items))
      for name <- names(items), do: assert(freed?(dir, name))
    end

    test "a reply decoded without its worker process (no pid to release to) still hands back its slots",
         %{dir: dir} do
      items = [{:raw, <<0xD4, 99, 0>>}, new_slot(dir), {:ref, new_ref()}]
      assert {:error, %Error{type: :protocol}} = Wire.decode_reply(frame(items), origin(), nil)
      for name <- names(items), do: assert(freed?(dir, name))
      # Nobody to release them to.
      assert releases() == []
    end
  end

  # -- a real worker -------------------------------------------------------------------

  describe "replies a real worker sends" do
    setup do
      {name, w} = slot_keeping_pool!("rt_refused", ["rt_forge"])
      %{pool: name, w: w}
    end

    defp held(w), do: elem(Worker.ping(w.pid), 1)["refs"]

    defp lent(dir, os_pid),
      do: dir |> File.ls!() |> Enum.filter(&(&1 =~ ~r/\Ar-#{os_pid}-\d+\z/))

    # A spec for rt_forge.refused_mix: "ref", "slot" (at most 3: a worker has 4 result
    # slots) and ints around one "refuse", nested in lists, tuples and maps.
    defp spec do
      leaves = for _ <- 1..Enum.random(2..8), do: Enum.random(["ref", "ref", "slot", 1])
      {slots, others} = Enum.split_with(leaves, &(&1 == "slot"))
      leaves = Enum.take(slots, 3) ++ others ++ ["ref", "slot"]
      {before, later} = Enum.split(Enum.shuffle(leaves), Enum.random(0..length(leaves)))
      spec_nest(before ++ ["refuse"] ++ later, 3)
    end

    defp spec_nest(items, 0), do: items

    defp spec_nest(items, depth) do
      items
      |> Enum.chunk_while([], &run/2, &{:cont, Enum.reverse(&1), []})
      |> Enum.flat_map(fn run ->
        case :rand.uniform(4) do
          1 ->
            [spec_nest(run, depth - 1)]

          2 ->
            [List.to_tuple(spec_nest(run, depth - 1))]

          3 ->
            [Map.new(Enum.with_index(spec_nest(run, depth - 1)), fn {v, i} -> {"k#{i}", v} end)]

          4 ->
            run
        end
      end)
    end

    test "every result slot goes back and every reference is released, in or out of a session",
         %{pool: pool, w: w, dir: dir, seed: seed} do
      {:ok, s} = Session.open(pool_name: pool)
      base = held(w)

      for round <- 1..8 do
        spec = spec()
        opts = [pool_name: pool, timeout: 60_000]
        opts = if rem(round, 2) == 0, do: [session_id: s.id] ++ opts, else: opts
        why = "seed #{seed}, round #{round}: #{inspect(spec)}"

        assert {:error, %Error{type: :protocol, message: msg}} =
                 VllmBridge.call({"rt_forge", "refused_mix"}, [spec], %{}, opts),
               why

        assert msg =~ "big integer (ext 7) of 4097 magnitude bytes is over the cap", why
        assert lent(dir, w.os_pid) == [], why
        wait_until(fn -> held(w) == base end, 10_000, "references released; #{why}")
      end

      Session.close(s)
      assert [%{os_pid: os_pid}] = workers!(pool)
      assert os_pid == w.os_pid
    end
  end
end
