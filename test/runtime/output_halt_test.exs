defmodule VllmBridge.Runtime.OutputHaltTest do
  @moduledoc """
  A BEAM that halts while its workers start leaves nothing of their output behind: no
  FIFO in the temporary folder, no reader (`cat`, or the shell that runs it) blocked for
  ever. The BEAM is a child OS process (`elixir` on this project's compiled code) that
  starts a pool and halts from its `:progress` callback when a worker has launched (its
  FIFOs made, its readers started, its hello not yet come). Only the child's own FIFO
  names and the processes that hold or name them are looked at: other BEAMs may run here.
  """
  use ExUnit.Case, async: false

  import VllmBridge.RuntimeHelpers

  @tag timeout: 180_000
  test "a BEAM halted during the start leaves no FIFO and no reader" do
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
        %{stage: :launch} -> :erlang.halt(0)
        _ -> :ok
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

    wait_until(
      fn -> fifos(prefix) == [] and holders(prefix) == [] end,
      60_000,
      "the child's FIFOs and the processes holding them to be gone " <>
        "(left: #{inspect(fifos(prefix))}, #{inspect(holders(prefix))})"
    )
  end

  defp fifos(prefix),
    do: System.tmp_dir!() |> File.ls!() |> Enum.filter(&String.starts_with?(&1, prefix))

  # Readers: processes whose command line names one of the FIFOs (a reader's shell, one
  # blocked in its open), and `cat`s or shells that have one open. (The Python process,
  # which has them open as its fds 1 and 2, goes when it finds its port closed: not the
  # readers' business.)
  defp holders(prefix) do
    for dir <- File.ls!("/proc"),
        dir =~ ~r/^\d+$/,
        named?(dir, prefix) or (comm(dir) in ["cat", "sh"] and holds?(dir, prefix)),
        do: dir
  end

  defp comm(dir) do
    case File.read("/proc/#{dir}/comm") do
      {:ok, comm} -> String.trim(comm)
      _ -> nil
    end
  end

  defp named?(dir, prefix) do
    case File.read("/proc/#{dir}/cmdline") do
      {:ok, cmd} -> String.contains?(cmd, prefix)
      _ -> false
    end
  end

  defp holds?(dir, prefix) do
    case File.ls("/proc/#{dir}/fd") do
      {:ok, fds} ->
        Enum.any?(fds, fn fd ->
          case File.read_link("/proc/#{dir}/fd/#{fd}") do
            {:ok, target} -> String.contains?(target, prefix)
            _ -> false
          end
        end)

      _ ->
        false
    end
  end
end
