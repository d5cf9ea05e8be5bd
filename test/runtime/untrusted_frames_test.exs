defmodule VllmBridge.Runtime.UntrustedFramesTest do
  @moduledoc """
  What a worker's Python process sends is untrusted (it runs user code): frames the
  worker's own encoder never writes, sent by user code (test/support/rt_forge.py) or
  handed to the worker process's routing as they would come from the port.

    * a result holding a raw `msgpack.ExtType` (which msgpack would pack as one of the
      protocol's own values: a reference, a result slot, ...) is refused by the worker's
      encoder: the caller gets the error naming it and where it sits, and the worker
      serves on;

    * a result slot (ext 8) is bounded like a reply through the pipe: its data and the
      frame together at most the worker's `max_frame_bytes`, refused (`:protocol`,
      naming the size and the limit) before the file is opened, and handed back; a
      sparse file declaring 1 TiB allocates nothing, and the worker serves on;
    * the worker process reads a frame's kind and id from its head, whatever its array
      and string forms, without decoding the rest: a reply with an array16 head reaches
      its caller with its result slot still there to read, and a frame of millions of
      values is not decoded in the worker process (nor is a dropped reply there);
    * a stray frame is logged by its kind, id, size and first bytes, never printed whole
      (a big integer takes quadratic time to print).
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import Bitwise, only: [<<<: 2]
  import ExUnit.CaptureLog
  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Bytes, Error, Shm, Tensor, Worker}
  alias VllmBridge.Call.Wire
  alias VllmBridge.Codec.SlotExt
  alias VllmBridge.Worker.{Calls, Unclaimed}
  alias VllmBridge.Worker.Messages.Submit

  @pool :rt_untrusted
  @small :rt_untrusted_small
  @forge "rt_forge"
  @diag "vllm_bridge.bridge.diag"

  setup_all do
    opts = [size: 1, allow: [@diag, @forge], worker_env: [python_path([support_dir()])]]
    start_pool!(@pool, opts)
    start_pool!(@small, [max_frame_bytes: 65_536] ++ opts)
    :ok
  end

  defp call(pool, module, name, args),
    do: VllmBridge.call({module, name}, args, %{}, pool_name: pool, timeout: 60_000)

  # A worker process's state, enough for routing frames (VllmBridge.Worker.route/2): its
  # Python process stands as this BEAM's os pid, whose result slot names the tests make.
  defp state(calls \\ Calls.new(nil, 0)) do
    %{
      pool: nil,
      index: nil,
      os_pid: 4242,
      loans: nil,
      calls: calls,
      max_frame: 1 <<< 20,
      origin: origin()
    }
  end

  defp origin, do: {1 <<< 20, String.to_integer(System.pid())}

  describe "result slots are bounded as replies through the pipe are" do
    setup do
      %{path: dir} = Shm.dir()
      [w] = workers!(@pool)
      [s] = workers!(@small)
      names = for w <- [w, s], n <- [900_001, 900_002], do: "r-#{w.os_pid}-#{n}"

      on_exit(fn ->
        for name <- names, suffix <- ["", ".free"], do: File.rm(Path.join(dir, name <> suffix))
      end)

      %{dir: dir, w: w, s: s}
    end

    test "a slot over the pool's max_frame_bytes is refused, naming its size and the limit",
         %{dir: dir, s: s} do
      name = "r-#{s.os_pid}-900001"

      assert {:error, %Error{type: :protocol, message: msg}} =
               call(@small, @forge, "forged_slot", [1 <<< 20, 900_001])

      assert msg =~ "the tensor slot \"#{name}\" (ext 8)"
      assert msg =~ "1048576 bytes"
      assert msg =~ "over the reply limit of 65536 bytes (max_frame_bytes)"
      # Handed back (renamed .free, as a slot refused for its size is), never read.
      assert File.exists?(Path.join(dir, name <> ".free"))
      refute File.exists?(Path.join(dir, name))

      # One within the limit still travels; the same Python process serves on.
      assert {:ok, %Tensor{shape: [1000], data: data}} =
               call(@small, @forge, "forged_slot", [1000, 900_002])

      assert data == <<0::1000*8>>
      assert {:ok, 3} = call(@small, @diag, "add", [1, 2])
      assert [%{os_pid: os_pid}] = workers!(@small)
      assert os_pid == s.os_pid
    end

    test "a sparse slot declaring 1 TiB allocates nothing; the worker and its pool serve on",
         %{dir: dir, w: w} do
      binary = :erlang.memory(:binary)
      total = :erlang.memory(:total)

      assert {:error, %Error{type: :protocol, message: msg}} =
               call(@pool, @forge, "forged_slot", [1 <<< 40, 900_001])

      assert msg =~ "1099511627776 bytes"
      assert msg =~ "over the reply limit of 1073741824 bytes (max_frame_bytes)"
      assert File.exists?(Path.join(dir, "r-#{w.os_pid}-900001.free"))
      assert :erlang.memory(:binary) - binary < 64 <<< 20
      assert :erlang.memory(:total) - total < 64 <<< 20

      assert {:ok, 3} = call(@pool, @diag, "add", [1, 2])
      assert [%{os_pid: os_pid}] = workers!(@pool)
      assert os_pid == w.os_pid
    end
  end

  describe "a result holding a raw msgpack.ExtType" do
    test "is refused by the worker's encoder, never read as a reference; the worker serves on" do
      [w] = workers!(@pool)

      for {where, at} <- [{"", "is a"}, {"nested", "(at ['refs'][1]) is a"}] do
        assert {:error, %Error{type: :python_exception, python_type: "TypeError", message: msg}} =
                 call(@pool, @forge, "forged_ext", [6, where])

        assert msg =~ ~r/^the reply to call \d+ #{Regex.escape(at)} msgpack.ExtType \(code 6, /
        assert msg =~ "which the peer would read as an object reference"
        assert {:ok, 3} = call(@pool, @diag, "add", [1, 2])
      end

      assert [%{os_pid: os_pid}] = workers!(@pool)
      assert os_pid == w.os_pid
    end
  end

  describe "log and hello frames never read a slot" do
    test "a slot named in a log frame is handed back unread, in a hello left alone" do
      %{path: dir} = Shm.dir()

      # What each says: the log line, the hello's refusal; whether the slot goes back (a
      # hello comes before its worker's pid is known, so no slot is its).
      for {check, back} <- [
            {fn ext -> capture_log(fn -> Worker.route(state(), log_frame(ext)) end) end, true},
            {fn ext -> inspect(VllmBridge.Worker.Hello.check(hello_frame(ext), 1 <<< 20)) end,
             false}
          ] do
        name = "r-#{System.pid()}-#{System.unique_integer([:positive])}"
        path = Path.join(dir, name)
        on_exit(fn -> for p <- [path, path <> ".free"], do: File.rm(p) end)
        # A file shorter than its shape says: a read of it fails, naming the slot.
        File.write!(path, <<1, 2, 3, 4>>)
        payload = SlotExt.payload(:uint8, [1000], "", name)
        said = check.(<<0xC7, byte_size(payload), 8, payload::binary>>)

        refute said =~ "holds 4 bytes", "the slot was read: #{said}"
        assert File.exists?(path <> ".free") == back
        assert File.exists?(path) == not back
      end
    end
  end

  defp log_frame(ext), do: <<0x94, 0xA3, "log", 0xA4, "info", 0xA1, "x", ext::binary>>

  defp hello_frame(ext),
    do: <<0x92, 0xA5, "hello", 0x81, 0xA4, "junk", ext::binary>>

  describe "the worker process reads only a frame's head" do
    test "an ok reply with an array16 head reaches its caller, its result slot unread" do
      %{path: dir} = Shm.dir()
      name = "r-#{System.pid()}-#{System.unique_integer([:positive])}"
      path = Path.join(dir, name)
      File.write!(path, <<1, 2, 3, 4>>)
      on_exit(fn -> for p <- [path, path <> ".free"], do: File.rm(p) end)

      payload = SlotExt.payload(:uint8, [4], "", name)
      frame = <<0xDC, 3::16, 0xA2, "ok", 5, 0xC7, byte_size(payload), 8, payload::binary>>
      alias = :erlang.alias()
      calls = Calls.add(Calls.new(nil, 0), %Submit{id: 5, alias: alias, frame: nil, size: 0})

      state = Worker.route(state(calls), frame)
      assert Calls.size(state.calls) == 0
      origin = origin()
      assert_received {^alias, :reply, ^frame, ^origin}

      assert File.exists?(path),
             "the worker process handed the slot back before its caller read it"

      assert {:ok, %Tensor{shape: [4], data: <<1, 2, 3, 4>>}} = Wire.decode_reply(frame, origin)
    end

    test "heads of every array and string form give the kind and the id" do
      for {array, str} <- [
            {<<0x93>>, <<0xA2, "ok">>},
            {<<0xDC, 3::16>>, <<0xD9, 2, "ok">>},
            {<<0xDD, 3::32>>, <<0xDA, 2::16, "ok">>},
            {<<0x93>>, <<0xDB, 2::32, "ok">>}
          ] do
        assert Wire.peek(<<array::binary, str::binary, 0xCD, 300::16, 0xC0>>) == {:ok, 300}
        # Read by its head alone: what follows is the caller's to decode (or refuse).
        assert Wire.peek(<<array::binary, str::binary, 7, 0xC1>>) == {:ok, 7}
      end

      assert Wire.peek(<<0xDC, 2::16, 0xA3, "end", 0xCC, 200>>) == {:end, 200}

      assert Wire.peek(<<0xDC, 4::16, 0xD9, 3, "log", 0xA1, "x", 0xA1, "y", 0xA1, "z">>) ==
               {:log, nil}

      assert Wire.peek(<<0xDC, 3::16, 0xA4, "oops", 5, 0xC0>>) == {:unknown, nil}
      assert Wire.peek(<<0xDC, 0::16>>) == {:unknown, nil}
      assert Wire.peek(<<0xDC, 3::16, 0xA2, "o">>) == {:unknown, nil}
      assert Wire.peek(<<0xC1>>) == {:unknown, nil}
      assert Wire.peek(<<>>) == {:unknown, nil}
    end

    test "a frame of millions of values is not decoded in the worker process" do
      [w] = workers!(@pool)
      n = 3_000_000
      body = <<0xDC, 3::16, 0xA4, "oops", 5, 0xDD, n::32, :binary.copy(<<0xA1, ?x>>, n)::binary>>
      {:reductions, before} = Process.info(w.pid, :reductions)

      # The stray frame goes out before the reply to the call that wrote it.
      assert {:ok, size} = call(@pool, @forge, "write_frame", [%Bytes{data: body}])
      assert size == byte_size(body)
      assert {:ok, 3} = call(@pool, @diag, "add", [1, 2])

      {:reductions, later} = Process.info(w.pid, :reductions)
      # A decode of the frame costs millions of reductions; routing it, a few hundred.
      assert later - before < 200_000
      assert [%{os_pid: os_pid}] = workers!(@pool)
      assert os_pid == w.os_pid
    end

    test "a large reply nobody reads is not decoded in the worker process" do
      n = 3_000_000
      body = <<0x93, 0xA2, "ok", 9, 0xDD, n::32, :binary.copy(<<0xA1, ?x>>, n)::binary>>
      {:reductions, before} = Process.info(self(), :reductions)
      assert :ok = Unclaimed.drop(body, origin())
      {:reductions, later} = Process.info(self(), :reductions)
      assert later - before < 100_000

      # A reference in a large dropped reply is still released (a release request to the
      # worker process: here, this process).
      ref = %VllmBridge.Ref{instance: "i", id: 3, session: nil, type: "T", node: node()}

      big =
        IO.iodata_to_binary(VllmBridge.Codec.encode(["ok", 9, [ref, :binary.copy("x", 10_000)]]))

      assert :ok = Unclaimed.drop(big, origin())
      assert_receive {:"$vb_req", %Submit{frame: frame}}, 5_000
      assert IO.iodata_to_binary(frame) =~ "release"
    end
  end

  describe "stray frames are logged by their head" do
    test "a stray frame holding a large big integer is logged by kind, id, size and first bytes" do
      mag = :binary.copy(<<0xFF>>, 100_000)
      bin = <<0x93, 0xA4, "oops", 0xCD, 777::16, 0xC9, 100_001::32, 7, 0, mag::binary>>

      log = capture_log(fn -> Worker.route(state(), bin) end)
      assert log =~ "frame without a call to answer"
      assert log =~ "#{byte_size(bin)} bytes"
      assert log =~ "93a46f6f7073cd0309"
      assert byte_size(log) < 1_000

      # A reply to no call: its kind and id.
      log = capture_log(fn -> Worker.route(state(), <<0x93, 0xA2, "ok", 0xC0, 0xC0>>) end)
      assert log =~ "frame without a call to answer (ok, no id; 6 bytes: 93a26f6bc0c0)"
    end
  end
end
