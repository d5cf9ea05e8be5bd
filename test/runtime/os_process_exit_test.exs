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

  # Reads alive?/1, then the thread count, as fast as it can until the process is
  # gone: the first count read after alive? said false (counts only fall, so it was at
  # least that high when alive? said so), or nil: gone.
  defp first_count_when_dead(os_pid) do
    if OsProcess.alive?(os_pid), do: first_count_when_dead(os_pid), else: os_threads(os_pid)
  end

  test "a killed process with threads is alive until its last thread has exited" do
    # Three kills: which thread exits last is the kernel's draw.
    for _ <- 1..3 do
      {_port, os_pid} = threaded_python!()
      assert :ok = OsProcess.kill(os_pid)
      assert first_count_when_dead(os_pid) in [nil, 1]
    end
  end
end
