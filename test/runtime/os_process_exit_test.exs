defmodule VllmBridge.Runtime.OsProcessExitTest do
  @moduledoc """
  A process killed with SIGKILL counts as gone (`OsProcess.alive?/1`, and so the
  worker's `await_gone/2` and `remaining/1`) only once its exit is done. With threads,
  its main thread reads as a zombie (`Z` in /proc/<pid>/stat) while another one still
  runs the exit and frees the memory (tens of ms for 256 MiB; the GPU's with it, for a
  worker with CUDA): before, that read as gone, and a stop returned with the process
  still there.
  """
  use ExUnit.Case, async: true

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Worker.OsProcess

  # A python3 with 256 MiB written and 8 threads asleep: its pid.
  defp threaded! do
    code =
      "import os, threading, time; x = b'\\1' * (256 << 20)\n" <>
        "for _ in range(8): threading.Thread(target=time.sleep, args=(60,)).start()\n" <>
        "os.write(1, b'ready\\n'); time.sleep(60)"

    python = System.find_executable("python3")
    port = Port.open({:spawn_executable, python}, [:binary, line: 64, args: ["-c", code]])
    {:os_pid, os_pid} = Port.info(port, :os_pid)
    kill_after_test(os_pid)
    assert_receive {^port, {:data, {:eol, "ready"}}}, 30_000
    os_pid
  end

  # Reads alive?/1, then the thread count, as fast as it can until the process is
  # gone: the first count read after alive? said false (counts only fall, so it was at
  # least that high when alive? said so), or :gone.
  defp first_count_when_dead(os_pid) do
    if OsProcess.alive?(os_pid), do: first_count_when_dead(os_pid), else: threads(os_pid)
  end

  defp threads(os_pid) do
    with {:ok, text} <- File.read("/proc/#{os_pid}/status"),
         [_, n] <- Regex.run(~r/^Threads:\s+(\d+)$/m, text) do
      String.to_integer(n)
    else
      _ -> :gone
    end
  end

  test "a killed process with threads is alive until its last thread has exited" do
    # Three kills: which thread exits last is the kernel's draw.
    for _ <- 1..3 do
      os_pid = threaded!()
      assert :ok = OsProcess.kill(os_pid)
      assert first_count_when_dead(os_pid) in [:gone, 1]
    end
  end
end
