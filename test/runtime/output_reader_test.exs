defmodule VllmBridge.Runtime.OutputReaderTest do
  @moduledoc """
  One output reader (`VllmBridge.Worker.Output`'s reader script, opened as the worker's
  Output opens it) ends in either way: its FIFO's last writer goes (`cat` ends) or its
  port closes (its watcher's lifeline), in both orders and with generated gaps between
  the two, down to none (a BEAM that halts closes both at once, and then either end may
  see it first). Whatever the order, nothing is left: no FIFO, no start-up stderr file,
  no process of the reader's. A file was left when `cat` ended first and the shell
  stopped the watcher after its `read` but before its `rm`
  (test/runtime/output_halt_test.exs failed so, once in five CI runs).
  """
  use ExUnit.Case, async: true

  import VllmBridge.RuntimeHelpers, only: [path_holders: 1]

  alias VllmBridge.Worker.Output

  setup do
    dir =
      Path.join(
        System.tmp_dir!(),
        "vb-reader-#{System.pid()}-#{System.unique_integer([:positive])}"
      )

    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf!(dir) end)
    %{dir: dir}
  end

  test "the FIFO's end first (the port still open): the shell exits 0 and removes both names",
       %{dir: dir} do
    {port, fifo, file, hold} = start_reader(dir, "a")
    :ok = :file.close(hold)
    assert_receive {^port, {:exit_status, 0}}, 30_000
    assert_gone(fifo, file)
  end

  test "the port's close first (the FIFO still held): the watcher removes both names",
       %{dir: dir} do
    {port, fifo, file, hold} = start_reader(dir, "b")
    Port.close(port)
    assert_gone(fifo, file)
    :ok = :file.close(hold)
  end

  test "both ends with generated gaps, in both orders: nothing is left", %{dir: dir} do
    # Gaps of 0 (back to back) to 2 000 microseconds, spun rather than slept (a sleep's
    # shortest is a millisecond), each order in turn.
    gaps = [0, 0, 0, 0] ++ for(_ <- 1..12, do: :rand.uniform(2_000))

    for {gap, i} <- Enum.with_index(gaps), order <- [:fifo_first, :port_first] do
      {port, fifo, file, hold} = start_reader(dir, "c#{i}-#{order}")

      case order do
        :fifo_first ->
          :ok = :file.close(hold)
          spin(gap)
          close(port)

        :port_first ->
          close(port)
          spin(gap)
          :ok = :file.close(hold)
      end

      assert_gone(fifo, file, "#{order} with a gap of #{gap} us")
    end
  end

  # A reader on FIFO `dir/<name>` with a start-up stderr file, as far as Output takes it
  # before the hello: "M" (made), the hold opened, "R" (the reader has it open).
  defp start_reader(dir, name) do
    fifo = Path.join(dir, name)
    file = Path.join(dir, name <> "-stderr")
    File.write!(file, "start-up stderr\n")
    port = Output.open_reader(fifo, file)
    assert_receive {^port, {:data, "M"}}, 30_000
    {:ok, hold} = :file.open(fifo, [:read, :write, :raw, :binary])
    assert_receive {^port, {:data, "R"}}, 30_000
    {port, fifo, file, hold}
  end

  defp close(port) do
    Port.close(port)
  rescue
    # (Closed already: its shell exited.)
    ArgumentError -> :ok
  end

  defp spin(us) do
    until = System.monotonic_time(:microsecond) + us
    spin_until(until)
  end

  defp spin_until(until) do
    if System.monotonic_time(:microsecond) < until, do: spin_until(until), else: :ok
  end

  # Within 10 s: both names gone, and no process of the reader's.
  defp assert_gone(fifo, file, what \\ "") do
    deadline = System.monotonic_time(:millisecond) + 10_000
    left = await(fn -> left(fifo, file) end, deadline)
    assert left == %{names: [], processes: []}, "#{what}: #{inspect(left)}"
  end

  defp await(f, deadline) do
    case f.() do
      %{names: [], processes: []} = none ->
        none

      some ->
        if System.monotonic_time(:millisecond) > deadline do
          some
        else
          Process.sleep(5)
          await(f, deadline)
        end
    end
  end

  defp left(fifo, file) do
    %{
      names: Enum.filter([fifo, file], &(File.lstat(&1) != {:error, :enoent})),
      processes: holders(fifo)
    }
  end

  # Processes whose command line names the FIFO (the reader's shell, its watcher, a
  # reader still blocked in its open) or that have it open (`cat`), orphans included; not
  # this BEAM (the test's hold).
  defp holders(fifo), do: path_holders(&(&1 == fifo or &1 == fifo <> " (deleted)"))
end
