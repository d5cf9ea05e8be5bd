defmodule VllmBridge.Runtime.ShmTest do
  @moduledoc """
  Large tensors through shared memory (VllmBridge.Shm, ext 8) on real workers: both
  directions, agreement with the pipe, lifetimes (a worker killed with kill -9 in the
  middle of a call, a caller killed, a pool stopped: no slot file left), a frame naming
  anything but a result slot refused. Not async: it looks at the node's slot directory,
  which every test's large tensors share.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Shm, Tensor}
  alias VllmBridge.Codec.SlotExt
  alias VllmBridge.Worker.OsProcess

  @pool :rt_shm
  @diag "vllm_bridge.bridge.diag"

  setup_all do
    start_pool!(@pool,
      size: 1,
      allow: [@diag, "rt_shm"],
      worker_env: [python_path([support_dir()])]
    )

    :ok
  end

  setup do
    %{path: dir} = Shm.dir()
    await_idle!(@pool)
    tmp = Path.join(System.tmp_dir!(), "rt_shm_#{System.unique_integer([:positive])}")
    File.mkdir_p!(tmp)
    on_exit(fn -> File.rm_rf!(tmp) end)
    %{dir: dir, tmp: tmp}
  end

  defp tensor(mib, seed) do
    n = div(mib * 1_048_576, 4)
    data = for i <- 0..1023, into: <<>>, do: <<i + seed::little-float-32>>
    Tensor.new(:binary.copy(data, div(n, 1024)), :float32, [n])
  end

  defp echo(t), do: VllmBridge.call({@diag, "echo"}, [t], %{}, pool_name: @pool)
  defp ls(dir), do: dir |> File.ls!() |> Enum.sort()
  # The directory empties within a bounded wait (saying what is left when it does not).
  defp empties(dir, keep \\ fn _ -> false end) do
    wait_until(fn -> Enum.all?(ls(dir), keep) end, 15_000, "the slot directory empties")
  rescue
    e in ExUnit.AssertionError ->
      reraise %{e | message: e.message <> ": #{inspect(ls(dir))}"}, __STACKTRACE__
  end

  defp os_pid, do: hd(workers!(@pool)).os_pid

  # The slots, whatever their state (lent, held by a worker, free).
  defp slots(dir),
    do: dir |> ls() |> Enum.map(&String.replace(&1, ~r/\.(free|held-\d+)\z/, "")) |> Enum.uniq()

  # The slot files, whatever their names: a worker lends a result slot's file again under
  # a new name (a name is lent once), so a file reused is seen by its inode. (A name
  # renamed between the listing and its lstat is missed: the callers ask again.)
  defp files(dir, names) do
    for name <- names, {:ok, st} <- [File.lstat(Path.join(dir, name))], uniq: true, do: st.inode
  end

  test "large tensors travel both ways through slots, small ones through the pipe", %{dir: dir} do
    big = tensor(8, 1)
    assert {:ok, ^big} = echo(big)
    pid = os_pid()
    names = slots(dir)

    assert Enum.any?(names, &(&1 =~ ~r/\Ar-#{pid}-\d+\z/)),
           "the result went through a slot: #{inspect(ls(dir))}"

    assert Enum.any?(names, &(&1 =~ ~r/\Ae-\d+\z/)), "the argument went through a slot"

    # Reused once handed back (the worker holds an argument's slot until its tensor is
    # gone, just after the reply): the same files carry the next large round trip (a
    # result's under a new name: compared by inode).
    # (Free slots expire after 2 s idle: on a loaded machine a round trip may come after
    # that, so reuse is asked of two round trips in a row, a bounded number of times.)
    other = tensor(5, 7)

    wait_until(
      fn ->
        wait_until(fn -> not Enum.any?(ls(dir), &(&1 =~ ".held-")) end, 15_000, "hand-back")
        before = Enum.sort(files(dir, ls(dir)))
        assert {:ok, ^other} = echo(other)
        before != [] and Enum.sort(files(dir, ls(dir))) == before
      end,
      30_000,
      "the next round trip reuses the same slot files"
    )

    wait_until(fn -> not Enum.any?(ls(dir), &(&1 =~ ".held-")) end, 15_000, "hand-back")
    names = slots(dir)

    # Below the threshold: the pipe, and the same answer.
    %{min_bytes: min} = Shm.dir()
    small = Tensor.new(:binary.copy(<<1, 2, 3, 4>>, div(min, 4) - 1), :int32, [div(min, 4) - 1])
    assert {:ok, ^small} = echo(small)
    assert slots(dir) == names
    # (What the caller sends: the small tensor inline, the large one as a slot's name.)
    # The scope's gate (is the route a worker that reads this directory?) is asked once,
    # at the first large tensor, never for small ones.
    me = self()

    sent = fn t, answer ->
      gate = fn ->
        send(me, :gate_asked)
        answer
      end

      Shm.scope(gate, fn ->
        {:ok, parts} = VllmBridge.Call.Wire.encode_invoke({@diag, "echo"}, [t, t], %{})
        IO.iodata_length(parts)
      end)
    end

    assert sent.(small, true) > 2 * byte_size(small.data)
    refute_received :gate_asked
    assert sent.(big, true) < 400
    assert_received :gate_asked
    refute_received :gate_asked
    # A gate that says no (another node's pool, say), outside a scope (a stream), and with
    # slots off: a large one goes inline.
    assert sent.(big, false) > 2 * byte_size(big.data)
    assert {:ok, parts} = VllmBridge.Call.Wire.encode_invoke({@diag, "echo"}, [big], %{})
    assert IO.iodata_length(parts) > byte_size(big.data)

    assert Shm.scope(fn -> true end, fn -> Shm.without(fn -> sent.(big, true) end) end) >
             2 * byte_size(big.data)

    # Nested in containers, several at once, each its own slot.
    assert {:ok, [^big, {^other, %{"x" => ^small}}]} =
             VllmBridge.call({@diag, "echo"}, [[big, {other, %{"x" => small}}]], %{},
               pool_name: @pool
             )
  end

  # A worker's result slots are reused while it returns large results back to back, and
  # deleted once it has not for a while (IDLE_AFTER_S, python/vllm_bridge/bridge/protocol/
  # slots.py): a worker that once returned a large result does not keep its pages.
  test "a busy worker's result slots are reused, an idle worker's go", %{dir: dir} do
    pid = os_pid()

    # Its result slot files, by inode (a file is lent again under a new name).
    results = fn -> files(dir, Enum.filter(ls(dir), &String.starts_with?(&1, "r-#{pid}-"))) end

    big = tensor(2, 11)
    assert {:ok, ^big} = echo(big)
    first = results.()
    assert first != []

    # (Asked of five round trips in a row, a bounded number of times: on a loaded machine
    # the gap between two may pass the idle period.)
    wait_until(
      fn ->
        before = results.()

        before != [] and
          Enum.all?(1..5, fn _ ->
            assert {:ok, ^big} = echo(big)
            results.() == before
          end)
      end,
      60_000,
      "back-to-back round trips reuse the same result slots"
    )

    wait_until(fn -> results.() == [] end, 30_000, "the idle worker's result slots go")
    # The next large result gets a new slot file.
    assert {:ok, ^big} = echo(big)
    assert [_ | _] = again = results.()
    assert MapSet.disjoint?(MapSet.new(again), MapSet.new(first))
  end

  test "a worker killed with kill -9 in the middle of a call leaves no slot behind",
       %{dir: dir, tmp: tmp} do
    assert {:ok, _} = echo(tensor(8, 2))
    old = os_pid()
    assert Enum.any?(ls(dir), &String.starts_with?(&1, "r-#{old}-"))

    started = Path.join(tmp, "started")

    caller =
      Task.async(fn ->
        VllmBridge.call({"rt_shm", "hold"}, [tensor(8, 3), started, Path.join(tmp, "never")], %{},
          pool_name: @pool
        )
      end)

    wait_until(fn -> File.exists?(started) end, 60_000, "the worker runs the call")
    # (The call's argument is in a slot, held by the worker that is about to die.)
    assert Enum.any?(ls(dir), &(&1 =~ ~r/\Ae-\d+\.held-#{old}\z/)), inspect(ls(dir))
    OsProcess.kill(old)

    assert {:error, %Error{type: :worker_exit}} = Task.await(caller, 60_000)
    # The killed worker's result slots are swept, its caller's argument slot is given
    # back, free slots expire: the directory empties.
    empties(dir)
    # The pool restarted the worker, and it serves large tensors again.
    assert os_pid() != old
    again = tensor(8, 4)
    assert {:ok, ^again} = echo(again)
  end

  test "a caller killed in the middle of a call leaves no slot behind", %{dir: dir, tmp: tmp} do
    started = Path.join(tmp, "started")
    gate = Path.join(tmp, "gate")

    caller =
      spawn(fn ->
        VllmBridge.call({"rt_shm", "hold"}, [tensor(8, 5), started, gate], %{}, pool_name: @pool)
      end)

    wait_until(fn -> File.exists?(started) end, 60_000, "the worker runs the call")
    # (The call's argument is in a slot, held by the worker, when its caller dies.)
    assert Enum.any?(ls(dir), &(&1 =~ ~r/\Ae-\d+\.held-#{os_pid()}\z/)), inspect(ls(dir))
    Process.exit(caller, :kill)
    File.write!(gate, "")
    await_idle!(@pool)

    wait_until(
      fn -> ls(dir) |> Enum.all?(&String.starts_with?(&1, "r-")) end,
      15_000,
      "the caller's slot is gone"
    )
  end

  test "stopping a pool removes its slots", %{dir: dir} do
    start_pool!(:rt_shm_stop, size: 1, allow: [@diag])
    big = tensor(6, 6)
    assert {:ok, ^big} = VllmBridge.call({@diag, "echo"}, [big], %{}, pool_name: :rt_shm_stop)
    [w] = workers!(:rt_shm_stop)
    assert Enum.any?(ls(dir), &String.starts_with?(&1, "r-#{w.os_pid}-"))
    :ok = VllmBridge.stop_pool(:rt_shm_stop)

    wait_until(
      fn -> not Enum.any?(ls(dir), &String.starts_with?(&1, "r-#{w.os_pid}-")) end,
      15_000,
      "the stopped worker's slots are gone"
    )

    wait_until(
      fn -> Enum.all?(ls(dir), &String.starts_with?(&1, "r-")) end,
      15_000,
      "the free argument slots expire"
    )
  end

  describe "a frame names a result slot, never a path" do
    setup %{dir: dir, tmp: tmp} do
      secret = Path.join(tmp, "secret")
      File.write!(secret, :binary.copy(<<1>>, 16))
      %{secret: secret, shm: Shm.dir(), dir: dir}
    end

    test "names of another pattern are refused", %{shm: shm, secret: secret} do
      for name <- [
            "../x",
            secret,
            "/etc/passwd",
            "e-1",
            "r-1",
            "r-1-1/../../x",
            "r-1-1.free",
            "",
            "r-01-x"
          ] do
        assert {:error, why} = SlotExt.read(shm, name, 16)
        assert why =~ "not the name of a result slot", name
      end
    end

    test "a link, a directory, a FIFO, a file of the wrong size or none are refused",
         %{shm: shm, secret: secret, dir: dir} do
      # Named as a live process's result slots (this BEAM's os pid), so that the sweep of
      # dead workers' slots leaves them alone.
      name = fn n -> "r-#{System.pid()}-#{900 + n}" end
      File.ln_s!(secret, Path.join(dir, name.(1)))
      File.mkdir!(Path.join(dir, name.(2)))
      File.write!(Path.join(dir, name.(3)), <<0::15*8>>)
      {_, 0} = System.cmd("mkfifo", [Path.join(dir, name.(5))])

      try do
        assert {:error, "is not a regular file (symlink)"} = SlotExt.read(shm, name.(1), 16)
        assert {:error, "is not a regular file (directory)"} = SlotExt.read(shm, name.(2), 16)

        assert {:error, "holds 15 bytes, the tensor needs 16"} = SlotExt.read(shm, name.(3), 16)

        # (Both causes named: its worker exited, or it was reclaimed past the age.)
        assert {:error, "is gone" <> _ = gone} = SlotExt.read(shm, name.(4), 16)
        assert gone =~ "its worker exited" and gone =~ "reclaim age"
        assert {:error, "is not a regular file (other)"} = SlotExt.read(shm, name.(5), 16)
        assert File.read!(secret) == :binary.copy(<<1>>, 16)
      after
        for n <- 1..5, s <- ["", ".free"], do: File.rm_rf!(Path.join(dir, name.(n) <> s))
      end
    end

    # A name swapped for a link between the lstat and the open (Elixir's open has no
    # O_NOFOLLOW): the hook runs there. The open file is compared with what was lstat'ed:
    # the link's target is neither read nor written.
    test "a slot swapped for a link after its lstat is neither read nor written through",
         %{shm: shm, secret: secret, dir: dir} do
      name = "r-#{System.pid()}-950"
      path = Path.join(dir, name)
      File.write!(path, <<0::16*8>>)

      swap = fn p ->
        if p == path do
          File.rm!(p)
          File.ln_s!(secret, p)
        end
      end

      try do
        Process.put(:vllm_bridge_slot_swap, swap)
        assert {:error, "was replaced" <> _} = SlotExt.read(shm, name, 16)
        File.rm_rf!(path <> ".free")
        File.rm_rf!(path)

        # A reused argument slot: the caller's write finds the link in its place.
        Process.delete(:vllm_bridge_slot_swap)
        big = tensor(2, 3)
        assert {:ok, ^big} = echo(big)

        wait_until(
          fn -> Enum.any?(ls(dir), &(&1 =~ ~r/\Ae-\d+\.free\z/)) end,
          15_000,
          "a free slot"
        )

        target = Path.join(Path.dirname(secret), "target")
        File.write!(target, "")

        me = self()

        Process.put(:vllm_bridge_slot_swap, fn p ->
          if Path.dirname(p) == dir and String.starts_with?(Path.basename(p), "e-") do
            send(me, {:swapped, Path.basename(p)})
            File.rm(p)
            File.ln_s!(target, p)
          end
        end)

        assert {:ok, ^big} = echo(big)
        assert_received {:swapped, "e-" <> _}
        assert File.read!(target) == "", "the write went through the link"
      after
        Process.delete(:vllm_bridge_slot_swap)
        File.rm_rf!(path)
        File.rm_rf!(path <> ".free")
      end

      assert File.read!(secret) == :binary.copy(<<1>>, 16)
    end

    # A reply nobody will read (its caller gave up) is decoded only for its references:
    # its result slots go back to the worker by rename, never opened or copied (a 64 MiB
    # tensor is not read into the worker process to be thrown away).
    test "a dropped reply hands its result slots back without opening them", %{dir: dir} do
      name = "r-#{System.pid()}-960"
      path = Path.join(dir, name)
      File.write!(path, <<0::16*8>>)
      me = self()
      payload = SlotExt.payload(:float32, [4], "", name)
      reply = IO.iodata_to_binary([0x93, 0xA2, "ok", 7, 0xC7, byte_size(payload), 8, payload])

      try do
        Process.put(:vllm_bridge_slot_swap, fn p -> send(me, {:opened, p}) end)
        # (This BEAM's os pid stands as the worker's: the slot is named for it.)
        origin = {1_048_576, String.to_integer(System.pid())}
        assert :ok = VllmBridge.Worker.Unclaimed.drop(reply, origin)
        refute_received {:opened, _}
        assert File.exists?(path <> ".free") and not File.exists?(path)

        # (The hook does see an ordinary decode open the slot.)
        File.rename!(path <> ".free", path)
        assert {:ok, %Tensor{}} = VllmBridge.Call.Wire.decode_reply(reply, origin)
        assert_received {:opened, ^path}
      after
        Process.delete(:vllm_bridge_slot_swap)
        File.rm_rf!(path)
        File.rm_rf!(path <> ".free")
      end
    end

    test "a reply naming a bad slot is a protocol error naming it", %{shm: shm} do
      payload = SlotExt.payload(:float32, [4], "", "../../etc/passwd")
      reply = IO.iodata_to_binary([0x93, 0xA2, "ok", 7, 0xC7, byte_size(payload), 8, payload])

      assert {:error, %Error{type: :protocol, message: msg}} =
               VllmBridge.Call.Wire.decode_reply(reply)

      assert msg =~ ~s(the tensor slot "../../etc/passwd")
      assert SlotExt.read(:disabled, "r-1-1", 4) == {:error, "this node has no slot directory"}
      assert {:error, "not the name" <> _} = SlotExt.read(shm, "../../etc/passwd", 4)
    end
  end

  # The bookkeeping process may crash: the directory stays (VllmBridge.Shm.Keeper owns it),
  # so workers given its path at their start keep reading the slots it then lends.
  test "large calls go on through slots after VllmBridge.Shm is killed", %{dir: dir} do
    before = slots(dir)
    restart_shm!()
    assert %{path: ^dir} = Shm.dir()
    assert File.dir?(dir)

    for seed <- 1..3 do
      big = tensor(2, seed)
      assert {:ok, ^big} = echo(big)
    end

    new = slots(dir) -- before
    assert Enum.any?(new, &(&1 =~ ~r/\Ae-\d+\z/)), "no new argument slot: #{inspect(ls(dir))}"
  end

  # An argument slot handed back after this process forgot it (a timeout settled while
  # the worker renamed it .held; or lent before a restart of VllmBridge.Shm): nobody
  # takes it again, so the sweep deletes it. One still being read (no .free) stays.
  test "the sweep deletes argument slots handed back that nobody tracks", %{dir: dir} do
    free = Path.join(dir, "e-99999999.free")
    lent = Path.join(dir, "e-99999998")
    File.write!(free, "x")
    File.write!(lent, "x")

    try do
      wait_until(fn -> not File.exists?(free) end, 15_000, "the untracked free slot goes")
      assert File.exists?(lent)
    after
      File.rm_rf!(free)
      File.rm_rf!(lent)
    end
  end

  # A worker that did not open this node's directory says so in its hello: its pool is
  # sent no slot names, and large tensors take the pipe without an error.
  test "a pool whose python wrapper drops the variable gets large tensors through the pipe",
       %{tmp: tmp} do
    pool = :"rt_shm_wrapped_#{System.unique_integer([:positive])}"
    start_pool!(pool, size: 2, python: python_wrapper(tmp, "unset VLLM_BRIDGE_SHM_DIR"))

    try do
      for seed <- 1..4 do
        big = tensor(2, seed)

        assert {:ok, [^big, ^big]} =
                 VllmBridge.call({@diag, "echo"}, [[big, big]], %{}, pool_name: pool)
      end
    after
      VllmBridge.stop_pool(pool)
    end
  end

  # One that opened another directory would name result slots this node cannot read.
  test "a worker that opened another slot directory is refused at its start, naming it",
       %{tmp: tmp} do
    other = Path.join(tmp, "other")
    File.mkdir_p!(other)
    File.chmod!(other, 0o700)
    python = python_wrapper(tmp, ~s(export VLLM_BRIDGE_SHM_DIR="#{other}"))
    pool = :"rt_shm_other_#{System.unique_integer([:positive])}"

    assert {:error, %Error{type: :bad_argument, message: m}} =
             VllmBridge.start_pool(pool, size: 1, python: python)

    assert m =~ other and m =~ Shm.dir().path, m
  end

  test "a root that cannot hold a directory gives none (tensors take the pipe)" do
    assert {:error, _} = Shm.Keeper.make_dir("/proc")
    assert {:error, _} = Shm.Keeper.make_dir("/etc/hostname")
    assert {:error, _} = Shm.Keeper.make_dir("/nonexistent/vllm_bridge")
    assert {:error, "shm_dir is off"} = Shm.Keeper.make_dir(false)
  end
end
