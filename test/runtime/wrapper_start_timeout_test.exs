defmodule VllmBridge.Runtime.WrapperStartTimeoutTest do
  @moduledoc """
  A worker that never serves leaves no process behind: a `python:` wrapper that starts
  its child in the background and exits at once, whose child never says hello (stuck in
  an import, say), is killed when its start times out, though neither the wrapper nor
  an announced Python process is there to follow to it: the child is found as a member
  of the port's process group started after the port opened.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log
  @moduletag :tmp_dir

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Error

  # A wrapper that puts `sleep 300` in the background, writes its pid to `pid_file`, and
  # exits: the child holds the port's pipes and never speaks.
  defp silent_child(tmp, pid_file) do
    path = Path.join(tmp, "silent-child.sh")

    File.write!(path, """
    #!/bin/sh
    sleep 300 &
    echo $! > '#{pid_file}.tmp' && mv '#{pid_file}.tmp' '#{pid_file}'
    exit 0
    """)

    File.chmod!(path, 0o755)
    path
  end

  defp child_pid!(pid_file) do
    wait_until(fn -> File.exists?(pid_file) end, 15_000, "the wrapper's child's pid")
    pid = pid_file |> File.read!() |> String.trim() |> String.to_integer()
    {^pid, _start} = kill_after_test(pid)
    pid
  end

  test "a start that times out kills the silent child of a wrapper that exited",
       %{tmp_dir: tmp} do
    pid_file = Path.join(tmp, "child.pid")
    opts = [size: 1, python: silent_child(tmp, pid_file), start_timeout: 5_000]

    starter = Task.async(fn -> VllmBridge.start_pool(:wrapper_start_timeout, opts) end)
    on_exit(fn -> VllmBridge.stop_pool(:wrapper_start_timeout) end)
    child = child_pid!(pid_file)
    assert os_alive?(child)

    assert {:error, %Error{type: :worker_exit, message: msg}} = Task.await(starter, 30_000)
    assert msg =~ "sent no handshake within 5000 ms"
    wait_until(fn -> not os_alive?(child) end, 15_000, "the child (os pid #{child}) killed")
  end
end
