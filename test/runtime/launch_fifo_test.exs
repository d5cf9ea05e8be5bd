defmodule VllmBridge.Runtime.LaunchFifoTest do
  @moduledoc """
  The launch script (`VllmBridge.Worker.Launcher.output_command/5`) against output FIFOs
  in every state a BEAM's death during a start can leave them in (their readers,
  `VllmBridge.Worker.Output`, delete the names and go when the BEAM dies, at any moment
  of the start): names gone before the script opens them, FIFOs with no reader at all,
  readers that go after the script opened them, and names deleted at generated moments
  of the script's run. Whatever the order, the script makes no file, never waits for ever
  in an open, and the Python process it runs exits once its port closes, however much it
  writes. Driven as `Launcher.open/1` drives it (a port, fds 3 and 4), running a real
  Python process: a probe that says "S" on fd 4 once its fds are set, floods its
  stdout and stderr when told ("g" on fd 3) and says "W" after, and exits at its port's
  EOF.
  """
  use ExUnit.Case, async: false

  alias VllmBridge.Worker.{Launcher, OsProcess}

  @probe ~S"""
  import os, sys
  err_fd = int(sys.argv[1])
  os.write(4, b"S")
  if os.read(3, 1) == b"g":
      for fd in (1, err_fd):
          data = memoryview(b"x" * (1 << 20))
          try:
              while data:
                  data = data[os.write(fd, data):]
          except OSError:
              pass
      os.write(4, b"W")
  while os.read(3, 65536):
      pass
  """

  setup do
    dir =
      Path.join(
        System.tmp_dir!(),
        "vb-launch-#{System.pid()}-#{System.unique_integer([:positive])}"
      )

    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf!(dir) end)
    %{dir: dir, out: Path.join(dir, "out"), err: Path.join(dir, "err")}
  end

  # With the start-up stderr captured (the default worker module) and without.
  defp variants(dir), do: [nil, Path.join(dir, "start-stderr")]

  defp launch({out, err}, file) do
    python = Application.fetch_env!(:vllm_bridge, :python)
    err_fd = if file, do: "5", else: "2"

    {exe, args, env} =
      Launcher.output_command({out, err}, file, python, ["-c", @probe, err_fd], [])

    port = Launcher.open_port(exe, args, env)
    {port, Launcher.os_pid(port)}
  end

  defp mkfifo(paths), do: {_, 0} = System.cmd("mkfifo", ["-m", "600" | paths])

  # "S" (the probe runs) or the script's exit status, whichever comes.
  defp started_or_exited(port) do
    receive do
      {^port, {:data, "S"}} -> :started
      {^port, {:exit_status, status}} -> {:exited, status}
    after
      60_000 -> flunk("the launch script neither ran the probe nor exited within 60 s")
    end
  end

  defp await_data(port, byte) do
    receive do
      {^port, {:data, ^byte}} -> :ok
      {^port, {:exit_status, status}} -> flunk("the probe exited (#{status}) before #{byte}")
    after
      60_000 -> flunk("no #{byte} from the probe within 60 s")
    end
  end

  # The port closes (EOF on the probe's fd 3): the process must go by itself.
  defp close_and_await_exit(port, os_pid) do
    Port.close(port)

    unless OsProcess.await_exit(os_pid, 30_000) do
      state = File.read("/proc/#{os_pid}/stat")
      OsProcess.kill(os_pid)
      flunk("os pid #{os_pid} still there 30 s after its port closed: #{inspect(state)}")
    end
  end

  defp type(path) do
    case File.lstat(path) do
      {:ok, %File.Stat{type: type}} -> type
      {:error, :enoent} -> :none
    end
  end

  # The probe's stdout and stderr: write-only (not readers of their own output), and the
  # script's fds 6 and 7 closed.
  defp assert_write_only(os_pid, err_fd) do
    for fd <- [1, err_fd] do
      [_, flags] = Regex.run(~r/flags:\s+([0-7]+)/, File.read!("/proc/#{os_pid}/fdinfo/#{fd}"))
      assert Bitwise.band(String.to_integer(flags, 8), 3) == 1, "fd #{fd} flags #{flags}"
    end

    refute File.exists?("/proc/#{os_pid}/fd/6")
    refute File.exists?("/proc/#{os_pid}/fd/7")
  end

  test "a name that is not a FIFO (gone, or a regular file) is refused and no file is made",
       %{dir: dir, out: out, err: err} do
    for file <- variants(dir), missing <- [:out, :err, :both], regular <- [false, true] do
      File.rm_rf!(out)
      File.rm_rf!(err)
      present = %{out: [err], err: [out], both: []}[missing]
      if present != [], do: mkfifo(present)
      absent = [out, err] -- present
      if regular, do: Enum.each(absent, &File.write!(&1, "not ours"))

      {port, _} = launch({out, err}, file)
      case_ = "#{inspect(missing)}, regular #{regular}, capture #{file != nil}"
      assert {:exited, status} = started_or_exited(port), case_
      assert status != 0, case_

      for path <- absent do
        if regular,
          do: assert(File.read!(path) == "not ours", case_),
          else: assert(type(path) == :none, case_)
      end

      for path <- present, do: assert(type(path) == :other, case_)
      if file, do: assert(type(file) == :none, case_)
    end
  end

  test "FIFOs with no reader at all: no wait, writes fail, the process exits at its port's EOF",
       %{dir: dir, out: out, err: err} do
    for file <- variants(dir) do
      File.rm_rf!(out)
      File.rm_rf!(err)
      mkfifo([out, err])
      {port, os_pid} = launch({out, err}, file)
      assert started_or_exited(port) == :started
      assert_write_only(os_pid, if(file, do: 5, else: 2))
      # 1 MiB to each: with a reader of its own (a read-write fd 1), the second 64 KiB
      # would wait for ever.
      Port.command(port, "g")
      await_data(port, "W")
      close_and_await_exit(port, os_pid)
      assert type(out) == :other
      assert type(err) == :other
    end
  end

  test "readers that go after the script opened the FIFOs: the process is not wedged",
       %{dir: dir, out: out, err: err} do
    for file <- variants(dir) do
      File.rm_rf!(out)
      File.rm_rf!(err)
      mkfifo([out, err])

      # Each FIFO read by a `cat` that is killed later, as a reader is when the BEAM dies.
      readers =
        for path <- [out, err] do
          Port.open({:spawn_executable, "/bin/sh"}, [
            {:args, ["-c", ~S'exec cat "$1" >/dev/null', "reader", path]},
            :exit_status
          ])
        end

      {port, os_pid} = launch({out, err}, file)
      assert started_or_exited(port) == :started
      assert_write_only(os_pid, if(file, do: 5, else: 2))

      # The watcher's order: the names go, then the readers are killed.
      File.rm!(out)
      File.rm!(err)
      for reader <- readers, do: OsProcess.kill(Launcher.os_pid(reader))

      for reader <- readers do
        assert_receive {^reader, {:exit_status, _}}, 30_000
      end

      Port.command(port, "g")
      await_data(port, "W")
      close_and_await_exit(port, os_pid)
      assert type(out) == :none
      assert type(err) == :none
    end
  end

  @tag timeout: 300_000
  test "names deleted at generated moments of the script's run: no file left, nothing wedged",
       %{dir: dir, out: out, err: err} do
    # The readers' watchers delete the names when the BEAM dies: any moment relative to
    # the script's tests and opens. Spread over the script's run by a spin of up to about a
    # millisecond, or a sleep of up to 20 ms, in either order; each outcome is fine (the
    # script refused, or it opened them and the probe ran), and must leave nothing.
    :rand.seed(:exsss, {19, 20, 21})

    for round <- 1..40 do
      file = Enum.at(variants(dir), rem(round, 2))
      File.rm_rf!(out)
      File.rm_rf!(err)
      if file, do: File.rm_rf!(file)
      mkfifo([out, err])
      {port, os_pid} = launch({out, err}, file)

      if rem(round, 4) == 0,
        do: Process.sleep(:rand.uniform(20)),
        else: spin(:rand.uniform(100_000))

      names = if rem(round, 3) == 0, do: [err, out], else: [out, err]
      Enum.each(names, &File.rm/1)

      outcome =
        case started_or_exited(port) do
          :started ->
            close_and_await_exit(port, os_pid)
            :ran

          {:exited, _status} ->
            :refused
        end

      what = "round #{round} (#{outcome}, capture #{file != nil})"
      assert type(out) == :none, what
      assert type(err) == :none, what
    end
  end

  defp spin(0), do: :ok
  defp spin(n), do: spin(n - 1)
end
