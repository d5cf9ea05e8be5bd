defmodule VllmBridge.Runtime.StartStderrTest do
  @moduledoc """
  A worker that cannot start says why: the last lines of its Python process's stderr are
  in the error (message and `details.stderr`), it is logged once, its start is not retried
  while start_pool waits, and no start-up stderr file is left behind. Real interpreters
  that lack what the worker needs: torch, the vllm_bridge package, a runnable python.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import ExUnit.CaptureLog
  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Pool}
  alias VllmBridge.Worker.Launcher

  # The interpreter the test venv was made from: no torch, no vllm_bridge of its own.
  defp base_python do
    {path, 0} =
      System.cmd(Application.fetch_env!(:vllm_bridge, :python), [
        "-c",
        "import sys; print(sys._base_executable, end='')"
      ])

    path
  end

  setup do
    dir = Path.join(System.tmp_dir!(), "vb-stderr-#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf!(dir) end)
    %{dir: dir}
  end

  # This BEAM's start-up stderr files in the temporary folder; unless the pool still
  # runs, its output FIFOs and their readers must be gone too, within a moment (a FIFO's
  # reader, VllmBridge.Worker.Output, outlives its worker by up to 2 s; an earlier test's
  # may still be finishing).
  defp leftovers(running \\ false) do
    unless running do
      wait_until(
        fn -> readers() == [] and in_tmp("vllm_bridge-out-#{System.pid()}-") == [] end,
        30_000,
        "the output readers and FIFOs to be gone"
      )
    end

    in_tmp("vllm_bridge-stderr-#{System.pid()}-")
  end

  defp in_tmp(prefix),
    do: System.tmp_dir!() |> File.ls!() |> Enum.filter(&String.starts_with?(&1, prefix))

  # The readers' shells (their command lines name the FIFO) and the `cat`s they run.
  defp readers do
    procs =
      for dir <- File.ls!("/proc"),
          {:ok, stat} <- [File.read("/proc/#{dir}/stat")],
          {:ok, cmd} <- [File.read("/proc/#{dir}/cmdline")],
          do:
            {dir, stat |> String.split(") ") |> List.last() |> String.split() |> Enum.at(1), cmd}

    shells =
      for {dir, _, cmd} <- procs,
          String.contains?(cmd, "vllm_bridge-out-#{System.pid()}-"),
          do: dir

    shells ++ for({dir, ppid, _} <- procs, ppid in shells, do: dir)
  end

  defp count(log, text), do: length(String.split(log, text)) - 1

  defp failed_start(pool, opts) do
    log =
      capture_log(fn ->
        send(self(), {:result, VllmBridge.start_pool(pool, opts)})
      end)

    assert_received {:result, {:error, %Error{} = e}}
    refute pool in Pool.names()
    {e, log}
  end

  test "a python without torch: ModuleNotFoundError in the error, logged once per worker", %{
    dir: dir
  } do
    # The venv's base interpreter (no torch) with our package and msgpack on its path.
    File.ln_s!(Path.expand("../../python/vllm_bridge", __DIR__), Path.join(dir, "vllm_bridge"))

    {msgpack, 0} =
      System.cmd(Application.fetch_env!(:vllm_bridge, :python), [
        "-c",
        "import msgpack, os; print(os.path.dirname(msgpack.__file__), end='')"
      ])

    File.ln_s!(msgpack, Path.join(dir, "msgpack"))

    {e, log} = failed_start(:ss_no_torch, python: base_python(), python_path: [dir], size: 1)
    assert e.type == :worker_exit
    assert e.message =~ "pool :ss_no_torch did not start: worker 0"
    assert e.message =~ "exited with status 1 before its handshake"
    assert e.message =~ "ModuleNotFoundError: No module named 'torch'"
    assert e.details.stderr =~ "Traceback (most recent call last)"
    assert e.details.stderr =~ "ModuleNotFoundError: No module named 'torch'"
    assert count(log, "No module named 'torch'") == 1
    assert leftovers() == []

    # Two workers: each fails once, neither is retried.
    {_e, log} = failed_start(:ss_no_torch2, python: base_python(), python_path: [dir], size: 2)
    # start_pool waits for worker 0 first: its failure is logged once, with its stderr;
    # worker 1 is stopped with the pool before or after its own failure (at most once).
    assert count(log, ":ss_no_torch2[0] failed to start") == 1
    assert count(log, ":ss_no_torch2[1] failed to start") in 0..1
    assert count(log, "No module named 'torch'") == count(log, "failed to start")
    assert leftovers() == []
  end

  test "a python without the vllm_bridge package: named, though none of our code ran", %{
    dir: dir
  } do
    # An isolated interpreter: no PYTHONPATH, no site-packages of the venv's.
    python = Path.join(dir, "isolated-python")
    File.write!(python, "#!/bin/sh\nexec #{base_python()} -I \"$@\"\n")
    File.chmod!(python, 0o755)

    {e, log} = failed_start(:ss_no_pkg, python: python, size: 1)
    assert e.message =~ "No module named 'vllm_bridge'"
    assert e.details.stderr =~ "No module named 'vllm_bridge'"
    assert count(log, "failed to start") == 1
    assert leftovers() == []
  end

  test "a broken python (its interpreter line names nothing): the shell's words", %{dir: dir} do
    python = Path.join(dir, "broken-python")
    File.write!(python, "#!/no/such/interpreter\n")
    File.chmod!(python, 0o755)

    {e, _log} = failed_start(:ss_broken, python: python, size: 1)
    assert e.type == :worker_exit
    assert e.details.stderr =~ python
    assert e.message =~ python
    assert leftovers() == []
  end

  test "a python that says nothing before it exits: the error says so", %{dir: dir} do
    python = Path.join(dir, "silent-python")
    File.write!(python, "#!/bin/sh\nexit 3\n")
    File.chmod!(python, 0o755)

    {e, _log} = failed_start(:ss_silent, python: python, size: 1)
    assert e.message =~ "status 3"
    assert e.message =~ "wrote nothing to stderr"
    assert e.details.stderr == nil
    assert leftovers() == []
  end

  test "a python that never shakes hands: the timeout's error has its stderr", %{dir: dir} do
    python = Path.join(dir, "mute-python")
    File.write!(python, "#!/bin/sh\necho 'still loading weights' >&2\nexec sleep 60\n")
    File.chmod!(python, 0o755)

    {e, _log} = failed_start(:ss_mute, python: python, size: 1, start_timeout: 500)
    assert e.message =~ "no handshake within 500 ms"
    assert e.message =~ "still loading weights"
    assert leftovers() == []
  end

  test "a worker that started: its stderr is its stderr FIFO again, its file is gone" do
    start_pool!(:ss_ok, size: 1)
    [%{os_pid: os_pid}] = workers!(:ss_ok)
    beam_stderr = File.read_link!("/proc/#{System.pid()}/fd/2")
    # Not the BEAM's: the FIFO its output reader reads (VllmBridge.Worker.Output), whose
    # name goes once both ends have it open (a cast after the hello: it may come after
    # the pool reports the worker ready).
    wait_until(
      fn ->
        File.read_link!("/proc/#{os_pid}/fd/2") =~ ~r/vllm_bridge-out-.*-err \(deleted\)$/
      end,
      10_000,
      "the stderr FIFO's name goes"
    )

    refute File.read_link!("/proc/#{os_pid}/fd/2") == beam_stderr
    # The fd that kept it during the start is closed, and the file gone.
    refute File.exists?("/proc/#{os_pid}/fd/5")
    assert leftovers(:running) == []
    # The os pid is the Python process itself (the launch script exec'd it).
    assert File.read!("/proc/#{os_pid}/cmdline") =~ "vllm_bridge.bridge.worker"

    {:ok, env} = VllmBridge.call({"vllm_bridge.bridge.diag", "info"}, [], %{}, pool_name: :ss_ok)
    assert env["pid"] == os_pid
  end

  test "a BEAM whose stdout and stderr are closed (a daemon's): the launch script runs the worker",
       %{dir: dir} do
    # The launch script itself, run the way the port runs it, but with fds 1 and 2 closed
    # first; a `cat` into a file reads each FIFO (the script refuses anything else).
    file = Path.join(dir, "start-stderr")
    out = Path.join(dir, "out")
    err = Path.join(dir, "err")
    {_, 0} = System.cmd("mkfifo", ["-m", "600", out, err])
    python = Application.fetch_env!(:vllm_bridge, :python)

    probe =
      "import os, sys; print(os.readlink('/proc/self/fd/5'), flush=True); " <>
        "print('start-up words', file=sys.stderr)"

    {exe, args, env} = Launcher.output_command({out, err}, file, python, ["-c", probe], [])
    env = for {k, v} <- env, do: {to_string(k), to_string(v)}

    # The readers end when the worker does (its FIFOs' only writer).
    readers = ~S'cat "$1" >"$1.read" & a=$!; cat "$2" >"$2.read" & b=$!; shift 2; '
    run = ~S'("$@" >&- 2>&-); s=$?; wait $a $b; exit $s'

    {_, status} =
      System.cmd("/bin/sh", ["-c", readers <> run, "closed", out, err, exe | args], env: env)

    # It ran, with the stderr FIFO kept on fd 5 and its start-up stderr in the file.
    assert status == 0
    assert File.read!(out <> ".read") == err <> "\n"
    assert File.read!(file) == "start-up words\n"
  end

  test "a pool stopped while its workers start leaves no file behind" do
    task = Task.async(fn -> VllmBridge.start_pool(:ss_stopped, size: 2) end)
    wait_until(fn -> :ss_stopped in Pool.names() end, 30_000, "the pool to exist")
    :ok = VllmBridge.stop_pool(:ss_stopped)
    # start_pool returns (an error, or :ok when it had finished first): it never exits
    # with the supervisor stop/1 ended under it.
    case Task.await(task, 60_000) do
      {:ok, _} -> :ok
      {:error, %VllmBridge.Error{message: m}} -> assert m =~ "pool :ss_stopped did not start"
    end

    VllmBridge.stop_pool(:ss_stopped)
    assert leftovers() == []
  end
end
