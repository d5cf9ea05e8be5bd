defmodule VllmBridge.WorkerSkeletonTest do
  use ExUnit.Case, async: true

  alias VllmBridge.Worker
  alias VllmBridge.Worker.{Framer, Hello, Launcher}

  # The hello of a raw port (what a worker process waits for while it starts).
  defp await_hello(port, framer \\ Framer.new()) do
    max = Launcher.default_max_frame_bytes()

    receive do
      {^port, {:data, data}} ->
        case Framer.feed(framer, data, max) do
          {:ok, [], framer} -> await_hello(port, framer)
          {:ok, [hello | _], _framer} -> Hello.check(hello, max)
        end
    after
      60_000 -> flunk("no hello within 60 s")
    end
  end

  test "the worker announces itself, then answers a call" do
    {:ok, w} = Worker.start_link()
    hello = Worker.hello(w)
    assert hello["protocol"] == 1
    assert is_integer(hello["pid"]) and hello["pid"] > 0
    assert hello["torch"] =~ ~r/^\d+\.\d+/
    assert hello["device"] in ["cpu"] or hello["device"] =~ ~r/^cuda:\d+$/

    assert {:ok, 42} = Worker.call(w, "vllm_bridge.bridge.diag", "add", [40, 2])

    assert {:ok, %{"x" => [1, 2.5, "s", nil]}} =
             Worker.call(w, "vllm_bridge.bridge.diag", "echo", [%{"x" => [1, 2.5, "s", nil]}])
  end

  test "a Python exception comes back as an error and the worker keeps serving" do
    {:ok, w} = Worker.start_link()
    # The call's 5 s deadline must not also cover torch's import on a loaded machine.
    {:ok, _hello} = Worker.await_ready(w)

    assert {:error, %VllmBridge.Error{type: :python_exception, python_type: "ValueError"} = e} =
             Worker.call(w, "vllm_bridge.bridge.diag", "sleep", [-1])

    assert e.message =~ "-1"
    assert {:ok, 3} = Worker.call(w, "vllm_bridge.bridge.diag", "add", [1, 2])
  end

  test "the Python process exits by itself when its port closes" do
    # A raw port, closed with nothing behind it that would kill a process that stays.
    {:ok, port} = VllmBridge.Worker.Launcher.open([])
    {:ok, %{"pid" => os_pid}} = await_hello(port)
    assert alive?(os_pid)
    Port.close(port)
    # What is asserted is that it goes at all: tearing down an interpreter with torch loaded
    # took over 1 s at load average 6, so the bound is only there to end the test.
    assert wait_gone(os_pid, 15_000), "python process #{os_pid} still alive 15 s after EOF"
  end

  test "closing a worker reports that its process left by itself" do
    {:ok, port} = VllmBridge.Worker.Launcher.open([])
    {:ok, %{"pid" => os_pid}} = await_hello(port)
    procs = VllmBridge.Worker.OsProcess.spawned(os_pid)
    assert VllmBridge.Worker.Launcher.close(port, procs, 5_000) == :exited
    refute alive?(os_pid)
  end

  test "a process that ignores EOF is killed after the grace period, and says so" do
    # `sleep` never reads its stdin-less port: it stands for a worker stuck past EOF.
    port = Port.open({:spawn_executable, System.find_executable("sleep")}, [{:args, ["60"]}])
    {:os_pid, os_pid} = Port.info(port, :os_pid)
    procs = VllmBridge.Worker.OsProcess.spawned(os_pid)

    log =
      ExUnit.CaptureLog.capture_log(fn ->
        assert VllmBridge.Worker.Launcher.close(port, procs, 200) == :killed
      end)

    assert log =~ "did not exit within 200 ms"
    assert wait_gone(os_pid, 5_000)
  end

  test "close returns once a killed process is gone, also one slow to tear down" do
    # A process killed with SIGKILL is still there (running its exit) until the kernel
    # has freed its memory: milliseconds for an interpreter with torch loaded, more on a
    # loaded machine; and with threads (torch's), the main one reads as a zombie while
    # another still frees it.
    {port, os_pid} = VllmBridge.RuntimeHelpers.threaded_python!()
    procs = VllmBridge.Worker.OsProcess.spawned(os_pid)

    ExUnit.CaptureLog.capture_log(fn ->
      assert VllmBridge.Worker.Launcher.close(port, procs, 50) == :killed
    end)

    # Not even a zombie with a thread still exiting (/proc/<pid>/status: Threads).
    refute alive?(os_pid)
    assert VllmBridge.RuntimeHelpers.os_threads(os_pid) in [nil, 1]
  end

  # One read of /proc/<pid>/stat (OsProcess.alive?/1): a look at the directory, then at
  # the file, raced with the reaping (a zombie reaped in between read as alive).
  defp alive?(os_pid), do: VllmBridge.Worker.OsProcess.alive?(os_pid)

  defp wait_gone(os_pid, ms) when ms <= 0, do: not alive?(os_pid)

  defp wait_gone(os_pid, ms) do
    if alive?(os_pid),
      do:
        (
          Process.sleep(20)
          wait_gone(os_pid, ms - 20)
        ),
      else: true
  end
end
