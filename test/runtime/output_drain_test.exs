defmodule VllmBridge.Runtime.OutputDrainTest do
  @moduledoc """
  A worker's last output is logged when its worker process goes, also what still waits
  in its output reader's mailbox (VllmBridge.Worker.Output drains it). Before, the
  worker was the reader's gen_server parent, whose exit stopped the reader at once with
  its mailbox unread. The reader is held (`:sys.suspend/1`) while the Python process
  prints, so that its lines are in the mailbox, not yet logged, when the worker process
  is killed. Real workers (test/support/rt_output.py).
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  @pool :rt_output_drain

  setup_all do
    start_pool!(@pool,
      size: 1,
      allow: ["rt_output"],
      worker_env: [python_path([support_dir()])]
    )

    :ok
  end

  test "lines waiting in the reader's mailbox are logged after its worker process is killed" do
    _ = VllmBridge.LogCollector.attach()
    [w] = workers!(@pool)
    [reader] = output_readers(w.pid)
    text = "drain-#{System.unique_integer([:positive])}"
    :ok = :sys.suspend(reader)
    assert {:ok, _} = VllmBridge.call({"rt_output", "say"}, [text], %{}, pool_name: @pool)

    # The line has reached the reader (a port message in its mailbox), unread.
    wait_until(fn ->
      match?({:message_queue_len, n} when n > 0, Process.info(reader, :message_queue_len))
    end)

    Process.exit(w.pid, :kill)
    # The worker's exit reached the reader (behind the line), which still runs.
    wait_until(fn -> not Process.alive?(w.pid) end)
    assert Process.alive?(reader)
    :ok = :sys.resume(reader)
    assert_receive {:log, :info, "[python stdout] " <> ^text, %{vllm_pool: @pool}}, 30_000
    workers!(@pool)
  end
end
