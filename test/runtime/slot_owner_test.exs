defmodule VllmBridge.Runtime.SlotOwnerTest do
  @moduledoc """
  A reply's result slots are its worker's own: a name `r-<os pid>-<n>` is read, handed
  back or renamed only when its pid is the OS pid of the Python process whose reply it
  is (the worker process tells its callers with each reply and chunk,
  VllmBridge.Worker.Messages). A worker runs user code, which can write any frame: one
  naming another worker's slot would otherwise read that worker's result and rename it
  `.free`, and that worker's caller would find it gone.

    * a real pool whose user code answers with an ext 8 naming a live slot of another
      pool's worker: the call is `:protocol`, naming the slot and saying it is not this
      worker's; the file is neither read nor renamed; the worker serves on;
    * a refused reply (VllmBridge.Call.Wire.Refused) hands back only its worker's names;
    * generated names (own pid, other pids, pid prefix and suffix tricks, leading zeros)
      through SlotExt: accepted exactly when the pid is the worker's; a reply decoded
      without a known worker accepts none.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Shm, Tensor}
  alias VllmBridge.Call.Wire
  alias VllmBridge.Call.Wire.Refused
  alias VllmBridge.Codec.SlotExt
  alias VllmBridge.Worker.Unclaimed

  @pool_a :rt_slot_owner_a
  @pool_b :rt_slot_owner_b
  @forge "rt_forge"
  @diag "vllm_bridge.bridge.diag"
  @limit 1_048_576

  setup_all do
    opts = [size: 1, allow: [@diag, @forge], worker_env: [python_path([support_dir()])]]
    start_pool!(@pool_a, opts)
    start_pool!(@pool_b, opts)
    :ok
  end

  setup do
    %{path: dir} = Shm.dir()
    %{dir: dir}
  end

  # A slot file `name` of 16 bytes of 7 (removed, under either name, at the test's end).
  defp slot_file(dir, name) do
    path = Path.join(dir, name)
    File.write!(path, :binary.copy(<<7>>, 16))
    on_exit(fn -> for p <- [path, path <> ".free"], do: File.rm(p) end)
    path
  end

  # An ext 8 of a uint8 tensor of 16 bytes in the slot `name`.
  defp ext(name) do
    payload = SlotExt.payload(:uint8, [16], "", name)
    <<0xC7, byte_size(payload), 8, payload::binary>>
  end

  # An ok reply whose value is the ext 8 of `name`, or a list of those of `names`.
  defp reply_naming(name) when is_binary(name), do: <<0x93, 0xA2, "ok", 7, ext(name)::binary>>

  defp reply_naming(names) when is_list(names),
    do: IO.iodata_to_binary([0x93, 0xA2, "ok", 7, 0x90 + length(names) | Enum.map(names, &ext/1)])

  defp untouched?(path),
    do: File.read(path) == {:ok, :binary.copy(<<7>>, 16)} and not File.exists?(path <> ".free")

  describe "a real worker naming another worker's slot" do
    test "is refused by name, the slot untouched; both workers serve on", %{dir: dir} do
      [a] = workers!(@pool_a)
      [b] = workers!(@pool_b)
      # A slot of B's live Python process, as B would lend it (the sweep keeps it: B lives).
      name = "r-#{b.os_pid}-#{System.unique_integer([:positive])}"
      path = slot_file(dir, name)

      assert {:error, %Error{type: :protocol, message: msg}} =
               VllmBridge.call({@forge, "named_slot"}, [16, name], %{},
                 pool_name: @pool_a,
                 timeout: 60_000
               )

      assert msg =~ ~s[the tensor slot "#{name}" (ext 8)]
      assert msg =~ "is not this worker's (os pid #{a.os_pid}"
      assert untouched?(path), "A's reply renamed or changed B's slot"

      # A serves on, the same Python process; so does B.
      assert {:ok, 3} = VllmBridge.call({@diag, "add"}, [1, 2], %{}, pool_name: @pool_a)
      assert [%{os_pid: os_pid}] = workers!(@pool_a)
      assert os_pid == a.os_pid
      assert {:ok, 5} = VllmBridge.call({@diag, "add"}, [2, 3], %{}, pool_name: @pool_b)

      # A's own slot still travels.
      n = System.unique_integer([:positive])
      own = Path.join(dir, "r-#{a.os_pid}-#{n}")
      on_exit(fn -> for p <- [own, own <> ".free"], do: File.rm(p) end)

      assert {:ok, %Tensor{shape: [64], data: <<0::64*8>>}} =
               VllmBridge.call({@forge, "forged_slot"}, [64, n], %{}, pool_name: @pool_a)
    end
  end

  describe "a refused reply" do
    test "hands back only its worker's own names", %{dir: dir} do
      own = "r-#{System.pid()}-#{System.unique_integer([:positive])}"
      # pid 1 lives as long as the machine: the sweep never deletes its names.
      foreign = "r-1-#{System.unique_integer([:positive])}"
      own_path = slot_file(dir, own)
      foreign_path = slot_file(dir, foreign)
      bin = reply_naming([foreign, own])

      assert :ok = Refused.settle(bin, {@limit, String.to_integer(System.pid())}, nil)
      assert untouched?(foreign_path)
      assert File.exists?(own_path <> ".free") and not File.exists?(own_path)

      # Without a known worker, nothing is renamed.
      File.rename!(own_path <> ".free", own_path)
      assert :ok = Refused.settle(bin, nil, nil)
      assert untouched?(foreign_path) and untouched?(own_path)
    end

    test "a reply refused for another worker's slot leaves that slot and hands back its own",
         %{dir: dir} do
      me = String.to_integer(System.pid())
      own = "r-#{me}-#{System.unique_integer([:positive])}"
      foreign = "r-1-#{System.unique_integer([:positive])}"
      own_path = slot_file(dir, own)
      foreign_path = slot_file(dir, foreign)
      bin = reply_naming([own, foreign])

      assert {:error, %Error{type: :protocol, message: msg}} =
               Wire.decode_reply(bin, {@limit, me}, self())

      assert msg =~ ~s["#{foreign}" (ext 8) is not this worker's (os pid #{me}]
      assert untouched?(foreign_path)
      assert File.exists?(own_path <> ".free") and not File.exists?(own_path)
    end

    test "a reply nobody reads hands back only its worker's slots, unread", %{dir: dir} do
      me = String.to_integer(System.pid())
      own_path = slot_file(dir, "r-#{me}-#{System.unique_integer([:positive])}")
      foreign = "r-1-#{System.unique_integer([:positive])}"
      foreign_path = slot_file(dir, foreign)

      assert :ok = Unclaimed.drop(reply_naming(Path.basename(own_path)), {@limit, me})
      assert :ok = Unclaimed.drop(reply_naming(foreign), {@limit, me})
      assert File.exists?(own_path <> ".free") and not File.exists?(own_path)
      assert untouched?(foreign_path)
    end
  end

  describe "generated names through SlotExt" do
    # Names around `pid`: its own, other pids, pids that are a prefix or an extension of
    # it, leading zeros, and malformed tails.
    defp names(pid) do
      p = Integer.to_string(pid)
      n = Integer.to_string(Enum.random(0..99_999))
      other = Integer.to_string(Enum.random(1..4_194_304))

      [
        {"r-#{p}-#{n}", true},
        {"r-#{other}-#{n}", other == p},
        {"r-#{p}#{Enum.random(0..9)}-#{n}", false},
        {"r-#{String.slice(p, 0..-2//1)}-#{n}", false},
        {"r-0#{p}-#{n}", false},
        {"r-#{p}-#{p}-#{n}", false},
        {"r-#{p}-", false},
        {"r-#{p}-#{n}x", false},
        {"r-#{p}-#{n}.free", false},
        {"r-#{p}", false},
        {"r--#{p}-#{n}", false},
        {"e-#{n}", false},
        {"R-#{p}-#{n}", false}
      ]
    end

    test "a name is the worker's exactly when its pid is" do
      for _ <- 1..2000 do
        pid = Enum.random([Enum.random(2..9), Enum.random(10..4_194_304)])

        for {name, own} <- names(pid) do
          assert SlotExt.own?(name, pid) == own, "#{inspect(name)} for os pid #{pid}"
          assert SlotExt.own?(name, nil) == false
        end
      end
    end

    test "a decode refuses every name not the worker's before touching a file" do
      for _ <- 1..300 do
        pid = Enum.random(10..4_194_304)

        for {name, false} <- names(pid) do
          # No file of that name exists: a read would say "is gone"; the owner check
          # comes first and says whose it is not.
          assert {:error, %Error{type: :protocol, message: msg}} =
                   Wire.decode_reply(reply_naming(name), {@limit, pid}, nil)

          assert msg =~ "the tensor slot #{inspect(name)} (ext 8)"
          assert msg =~ "is not this worker's (os pid #{pid}" or msg =~ "not the name of"
          refute msg =~ "is gone"
        end
      end
    end

    test "a reply decoded without a known worker accepts no slot", %{dir: dir} do
      name = "r-#{System.pid()}-#{System.unique_integer([:positive])}"
      path = slot_file(dir, name)

      assert {:error, %Error{type: :protocol, message: msg}} =
               Wire.decode_reply(reply_naming(name))

      assert msg =~ ~s[the tensor slot "#{name}" (ext 8)]
      assert msg =~ "no worker is known"
      assert untouched?(path)

      me = String.to_integer(System.pid())

      assert {:ok, %Tensor{data: data}} = Wire.decode_reply(reply_naming(name), {@limit, me}, nil)

      assert data == :binary.copy(<<7>>, 16)
      assert File.exists?(path <> ".free")
    end
  end
end
