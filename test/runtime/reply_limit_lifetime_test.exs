defmodule VllmBridge.Runtime.ReplyLimitLifetimeTest do
  @moduledoc """
  A reply's result slots are bounded by the frame limit (`max_frame_bytes`) of the pool
  whose worker sent it, also when the caller reads the reply after that worker process
  has ended (its pool stopped with the reply still in the caller's mailbox): a pool with
  a small limit does not get the looser default (a forged slot could then ask up to
  1 GiB), and one with a limit over the default does not have its large replies refused.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import Bitwise, only: [<<<: 2]
  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Shm}
  alias VllmBridge.Call.{Request, Wire}

  @forge "rt_forge"

  # Starts a pool of one worker with frame limit `max`, has it answer a forged result slot
  # of `nbytes` for each `{nbytes, n}` of `slots` (named `r-<os pid>-<n>`), waits until
  # every reply is in this mailbox, undecoded, and stops the pool. The handles and slot
  # names, once the worker process is gone.
  defp replies_after_stop(name, max, slots) do
    opts = [size: 1, max_frame_bytes: max, allow: [@forge]]
    {:ok, _} = VllmBridge.start_pool(name, opts ++ [worker_env: [python_path([support_dir()])]])
    on_exit(fn -> VllmBridge.stop_pool(name) end)
    [w] = workers!(name)
    %{path: dir} = Shm.dir()

    sent =
      for {nbytes, n} <- slots do
        {:ok, parts} = Wire.encode_invoke({@forge, "forged_slot"}, [nbytes, n], %{})
        req = Request.new("call", pre: [Wire.value(nil)], post: parts, target: {@forge, "x"})
        {_pid, _id, mref} = handle = Request.send_request(w.pid, req, :infinity)
        path = Path.join(dir, "r-#{w.os_pid}-#{n}")
        on_exit(fn -> for p <- [path, path <> ".free"], do: File.rm(p) end)
        {handle, mref, path}
      end

    wait_until(
      fn -> Enum.all?(sent, fn {_, mref, _} -> reply_waiting?(mref) end) end,
      60_000,
      "the replies in the mailbox"
    )

    ref = Process.monitor(w.pid)
    :ok = VllmBridge.stop_pool(name)
    assert_receive {:DOWN, ^ref, :process, _, _}, 30_000
    for {handle, _mref, path} <- sent, do: {handle, path}
  end

  # Whether a message on `mref` waits in this mailbox (whatever its shape).
  defp reply_waiting?(mref) do
    {:messages, messages} = Process.info(self(), :messages)
    Enum.any?(messages, &(is_tuple(&1) and elem(&1, 0) == mref))
  end

  test "a pool's small limit still bounds a reply read after its worker process ended" do
    [{handle, path}] = replies_after_stop(:rt_limit_small, 65_536, [{1 <<< 20, 910_001}])

    assert {:error, %Error{type: :protocol, message: msg}} = Request.await(handle, :infinity)
    assert msg =~ "the tensor slot \"#{Path.basename(path)}\" (ext 8)"
    assert msg =~ "over the reply limit of 65536 bytes (max_frame_bytes)"
  end

  test "a pool's limit over the default still bounds a reply read after its worker ended" do
    big = 3 <<< 30
    within = (3 <<< 29) + 1
    over = big + 1

    [{within_handle, within_path}, {over_handle, over_path}] =
      replies_after_stop(:rt_limit_big, big, [{within, 910_002}, {over, 910_003}])

    # The slot within the pool's limit (over the default's) is not refused for its size:
    # the read gets as far as the file (deleted here, so as not to read 1.5 GiB; the
    # sweep of a gone worker's result slots may have deleted it already, on a loaded
    # machine, where the stop took a while).
    _ = File.rm(within_path)
    refute File.exists?(within_path)

    assert {:error, %Error{type: :protocol, message: msg}} =
             Request.await(within_handle, :infinity)

    assert msg =~ "the tensor slot \"#{Path.basename(within_path)}\" (ext 8): is gone"
    refute msg =~ "reply limit"

    # One over it is refused, naming the pool's limit.
    assert {:error, %Error{type: :protocol, message: msg}} = Request.await(over_handle, :infinity)
    assert msg =~ "the tensor slot \"#{Path.basename(over_path)}\" (ext 8)"
    assert msg =~ "over the reply limit of #{big} bytes (max_frame_bytes)"
  end
end
