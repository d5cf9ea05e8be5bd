defmodule VllmBridge.Runtime.OutputHaltTest do
  @moduledoc """
  A BEAM that halts while its workers start leaves nothing of their output behind: no
  FIFO (nor a regular file at a FIFO's name) and no start-up stderr file
  (`vllm_bridge-stderr-<pid>-*`, which the readers' watchers delete) in the temporary
  folder, no reader (`cat`, or the shell that runs it) and no launch script blocked for
  ever. The BEAM is a child
  OS process (`elixir` on this project's compiled code) that starts a pool of two and
  halts from its `:progress` callback when a worker has launched (its FIFOs made, its
  readers started, its launch script running, its hello not yet come), after a delay
  that differs per round: the callback runs in a process of its own, so the halt falls
  at a different moment of each worker's start (the other worker may not have made its
  FIFOs yet), and the launch scripts' opens race their readers' watchers.
  (test/runtime/launch_fifo_test.exs drives the launch script through each order.) Only
  the child's own names and the processes that hold or name them are looked at: other
  BEAMs may run here.
  """
  use ExUnit.Case, async: false

  import VllmBridge.RuntimeHelpers, only: [path_holders: 1]

  @tag timeout: 600_000
  test "a BEAM halted during the start leaves no FIFO, no stderr file and no reader" do
    for delay_ms <- [0, 0, 5, 50, 200], do: halt_during_start(delay_ms)
  end

  defp halt_during_start(delay_ms) do
    elixir = System.find_executable("elixir") || flunk("no elixir executable on PATH")
    ebin = Path.join(Mix.Project.build_path(), "lib/vllm_bridge/ebin")
    python = Application.fetch_env!(:vllm_bridge, :python)

    script = """
    Application.put_env(:vllm_bridge, :python, #{inspect(python)})
    {:ok, _} = Application.ensure_all_started(:vllm_bridge)
    IO.puts("child-pid #{"\#{System.pid()}"}")

    VllmBridge.start_pool(:halting,
      size: 2,
      start_timeout: 120_000,
      progress: fn
        %{stage: :launch} ->
          Process.sleep(#{delay_ms})
          :erlang.halt(0)

        _ ->
          :ok
      end
    )

    IO.puts("not halted")
    """

    # Its output goes to a file, not a pipe here: a reader left behind holding the child's
    # stdout would keep System.cmd/3 waiting for ever.
    log =
      Path.join(System.tmp_dir!(), "vllm_bridge-halt-test-#{System.unique_integer([:positive])}")

    on_exit(fn -> File.rm(log) end)

    {_, status} =
      System.cmd("sh", [
        "-c",
        ~S(exec "$0" -pa "$1" -e "$2" >"$3" 2>&1),
        elixir,
        ebin,
        script,
        log
      ])

    out = File.read!(log)
    assert status == 0, out
    refute out =~ "not halted"
    [_, child] = Regex.run(~r/child-pid (\d+)/, out)
    # Nothing of the readers reached the BEAM's stderr (a `cat` that lost its port).
    refute out =~ "cat:"
    prefix = "vllm_bridge-out-#{child}-"
    stderr_prefix = "vllm_bridge-stderr-#{child}-"

    # What remained is reported as it is at the end of the wait, not as it was before.
    left = await_gone(prefix, stderr_prefix, System.monotonic_time(:millisecond) + 60_000)

    assert left == {[], []},
           "halted #{delay_ms} ms after a launch: still there 60 s later (names with " <>
             "their types, then the processes holding or naming them): #{inspect(left)}"
  end

  defp await_gone(prefix, stderr_prefix, deadline) do
    left = {names([prefix, stderr_prefix]), holders(prefix)}

    if left == {[], []} or System.monotonic_time(:millisecond) > deadline do
      {for(name <- elem(left, 0), do: {name, type(name)}),
       for(pid <- elem(left, 1), do: {pid, comm(pid), cmdline(pid)})}
    else
      Process.sleep(50)
      await_gone(prefix, stderr_prefix, deadline)
    end
  end

  defp type(name) do
    case File.lstat(Path.join(System.tmp_dir!(), name)) do
      {:ok, %File.Stat{type: :other}} -> :fifo
      {:ok, %File.Stat{type: type}} -> type
      {:error, reason} -> reason
    end
  end

  defp cmdline(dir) do
    case File.read("/proc/#{dir}/cmdline") do
      {:ok, cmd} -> String.replace(cmd, <<0>>, " ")
      _ -> nil
    end
  end

  # The FIFOs and the start-up stderr files of the child.
  defp names(prefixes),
    do: System.tmp_dir!() |> File.ls!() |> Enum.filter(&String.starts_with?(&1, prefixes))

  # Processes whose command line names one of the FIFOs (a reader's shell, a launch
  # script, either of them blocked in an open), and any that has one open: `cat`, and the
  # Python process (its fds 1 and 2), which goes when it finds its port closed.
  defp holders(prefix), do: path_holders(&String.contains?(&1, prefix))

  defp comm(dir) do
    case File.read("/proc/#{dir}/comm") do
      {:ok, comm} -> String.trim(comm)
      _ -> nil
    end
  end
end
