defmodule VllmBridge.Runtime.ShmBeamTest do
  @moduledoc """
  The node's slot directory (VllmBridge.Shm) seen from outside a BEAM run in its own OS
  process (`mix run`): kill -9 of that BEAM removes its directory (the keeper), and a
  root that cannot hold one leaves large tensors on the pipe, with no error.
  """
  use ExUnit.Case, async: true
  @moduletag :capture_log
  @moduletag timeout: 240_000

  import VllmBridge.RuntimeHelpers

  @script ~S"""
  t = VllmBridge.Tensor.new(:binary.copy(<<0, 0, 128, 63>>, 2_000_000), :float32, [2_000_000])
  {:ok, _} = VllmBridge.start_pool(:beam, size: 1, allow: ["vllm_bridge.bridge.diag"])
  {:ok, [w]} = VllmBridge.Pool.workers(:beam)
  {:ok, back} = VllmBridge.call({"vllm_bridge.bridge.diag", "echo"}, [t], %{}, pool_name: :beam)
  files = case VllmBridge.Shm.dir() do
    %{path: p} -> File.ls!(p) |> Enum.sort() |> Enum.join(",")
    :disabled -> ""
  end
  IO.puts("report pid=#{System.pid()} worker=#{w.os_pid} echo=#{back == t} " <>
    "dir=#{with %{path: p} <- VllmBridge.Shm.dir(), do: p} files=#{files}")
  Process.sleep(:infinity)
  """

  # Starts a BEAM with the application (test config), waits for its report line.
  defp start_beam(env) do
    port =
      Port.open({:spawn_executable, System.find_executable("mix")}, [
        :binary,
        :exit_status,
        :stderr_to_stdout,
        {:line, 65_536},
        args: ["run", "--no-compile", "--no-deps-check", "-e", @script],
        env: [{~c"MIX_ENV", ~c"test"} | env],
        cd: File.cwd!()
      ])

    {port, await_report(port, "")}
  end

  defp await_report(port, seen) do
    receive do
      {^port, {:data, {:eol, "report " <> report}}} ->
        for pair <- String.split(report, " "), into: %{} do
          [k, v] = String.split(pair, "=", parts: 2)
          {k, v}
        end

      {^port, {:data, {_, line}}} ->
        await_report(port, seen <> line <> "\n")

      {^port, {:exit_status, status}} ->
        flunk("the BEAM exited with #{status} before its report:\n#{seen}")
    after
      180_000 -> flunk("no report from the BEAM within 180 s:\n#{seen}")
    end
  end

  test "kill -9 of a BEAM removes its slot directory (and its workers' slots)" do
    {port, report} = start_beam([])
    assert report["echo"] == "true"
    dir = report["dir"]
    worker = String.to_integer(report["worker"])
    assert dir =~ ~r{\A/dev/shm/vllm_bridge-\d+-[0-9a-f]+\z}
    assert report["files"] =~ ~r/r-#{worker}-0\.free/, "the echo went through slots"
    assert File.dir?(dir)

    {_, 0} = System.cmd("kill", ["-9", report["pid"]])
    assert_receive {^port, {:exit_status, _}}, 30_000
    wait_until(fn -> not File.exists?(dir) end, 10_000, "#{dir} is removed")
    wait_until(fn -> not os_alive?(worker) end, 10_000, "the BEAM's worker is gone")
  end

  test "a root that cannot hold a directory leaves large tensors on the pipe, no error" do
    {port, report} = start_beam([{~c"ELIXIR_ERL_OPTIONS", ~c"-vllm_bridge shm_dir \"/proc\""}])
    assert report["echo"] == "true"
    assert report["dir"] == "disabled"
    assert report["files"] == ""
    {_, 0} = System.cmd("kill", ["-9", report["pid"]])
    assert_receive {^port, {:exit_status, _}}, 30_000
  end
end
