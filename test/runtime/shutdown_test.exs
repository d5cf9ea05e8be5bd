defmodule VllmBridge.Runtime.ShutdownTest do
  @moduledoc """
  No Python process outlives the runtime: not when the application stops (every pool,
  configured or started at run time), and not when the whole BEAM is killed with
  kill -9 (a separate BEAM OS process, started here, running a pool of 2): neither the
  workers nor a process a worker's code started in its group (the worker's sentinel,
  vllm_bridge.bridge.worker.sentinel, ends those). One started in a session of its own
  has left the worker, and is left alone, as a stop leaves it.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Pool

  test "Application.stop(:vllm_bridge) leaves no Python process of any pool" do
    old_pools = Application.fetch_env(:vllm_bridge, :pools)

    on_exit(fn ->
      case old_pools do
        {:ok, v} -> Application.put_env(:vllm_bridge, :pools, v)
        :error -> Application.delete_env(:vllm_bridge, :pools)
      end

      {:ok, _} = Application.ensure_all_started(:vllm_bridge)
    end)

    # A pool from the application config (started with the application) ...
    Application.put_env(:vllm_bridge, :pools, rt_cfg: [size: 2])
    :ok = Application.stop(:vllm_bridge)
    {:ok, _} = Application.ensure_all_started(:vllm_bridge)
    assert :rt_cfg in Pool.names()

    assert {:ok, 3} =
             VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [1, 2], %{}, pool_name: :rt_cfg)

    # ... and one started at run time, busy in a call.
    {:ok, _} = VllmBridge.start_pool(:rt_run, size: 1)

    busy =
      Task.async(fn ->
        VllmBridge.call({"vllm_bridge.bridge.diag", "sleep"}, [60], %{}, pool_name: :rt_run)
      end)

    wait_until(fn -> Enum.any?(workers!(:rt_run), &(&1.load == 1)) end)
    os_pids = for p <- [:rt_cfg, :rt_run], w <- workers!(p), do: w.os_pid
    assert length(os_pids) == 3 and Enum.all?(os_pids, &os_alive?/1)

    :ok = Application.stop(:vllm_bridge)
    assert {:error, %VllmBridge.Error{type: :worker_exit}} = Task.await(busy, 30_000)
    # Stopping waits for each worker's process to be gone.
    assert Enum.filter(os_pids, &os_alive?/1) == []

    # Started again without the configured pool: no pool, and calls say so.
    Application.delete_env(:vllm_bridge, :pools)
    {:ok, _} = Application.ensure_all_started(:vllm_bridge)
    assert Pool.names() == []

    assert {:error, %VllmBridge.Error{type: :bad_argument}} =
             VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [1, 2], %{}, pool_name: :rt_cfg)
  end

  # A BEAM of its own: starts the application with a configured pool of 2, has a worker
  # start a `sleep` in its group and one in a session of its own (rt_spawn.py), prints
  # its own OS pid, those two's and its workers', then waits to be killed.
  @script """
  [python, python_path] = System.argv()
  Application.put_env(:vllm_bridge, :python, python)

  Application.put_env(:vllm_bridge, :pools,
    default: [size: 2, modules: ["rt_spawn"], worker_env: [{"PYTHONPATH", python_path}]]
  )

  {:ok, _} = Application.ensure_all_started(:vllm_bridge)
  {:ok, 5} = VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [2, 3])
  {:ok, in_group} = VllmBridge.call({"rt_spawn", "sleeper"}, [300, false])
  {:ok, own_session} = VllmBridge.call({"rt_spawn", "sleeper"}, [300, true])
  {:ok, ws} = VllmBridge.Pool.workers(:default)
  pids = [System.pid(), in_group, own_session | Enum.map(ws, & &1.os_pid)]
  IO.puts("READY " <> Enum.map_join(pids, " ", &to_string/1))
  Process.sleep(:infinity)
  """

  test "a BEAM killed with kill -9 leaves no Python process, nor one its workers started" do
    python = Application.fetch_env!(:vllm_bridge, :python)
    {"PYTHONPATH", python_path} = python_path([support_dir()])
    port = open_beam([], @script, [python, python_path])

    [beam, in_group, own_session | workers] =
      read_ready(port, "") |> String.split() |> Enum.map(&String.to_integer/1)

    for pid <- [in_group, own_session], do: kill_after_test(pid)
    assert length(workers) == 2
    assert Enum.all?([beam, in_group, own_session | workers], &os_alive?/1)

    System.cmd("kill", ["-9", "#{beam}"])
    assert_receive {^port, {:exit_status, 137}}, 30_000

    wait_until(fn -> not Enum.any?(workers, &os_alive?/1) end, 10_000, "the workers gone")
    wait_until(fn -> not os_alive?(in_group) end, 10_000, "the child in the group gone")
    # Well past the sentinel's look at the BEAM (once a second, and at the
    # interpreter's end): still there.
    Process.sleep(2_500)
    assert os_alive?(own_session)
  end

  # A BEAM that is pid 1 of a pid namespace of its own, as a container's init is:
  # `unshare` makes one where the kernel lets it (user namespaces).
  {out, status} =
    System.cmd("sh", ["-c", "unshare -Urpf --mount-proc true 2>&1"], stderr_to_stdout: true)

  if status != 0 do
    @tag skip: "cannot make a pid namespace here (unshare -Urpf: #{String.trim(out)})"
  end

  test "a BEAM that is pid 1 starts its workers, which need no sentinel there" do
    python = Application.fetch_env!(:vllm_bridge, :python)

    script = """
    [python] = System.argv()
    Application.put_env(:vllm_bridge, :python, python)
    {:ok, _} = Application.ensure_all_started(:vllm_bridge)
    {:ok, _} = VllmBridge.start_pool(:one, size: 1)
    {:ok, 5} = VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [2, 3], %{}, pool_name: :one)
    {:ok, [w]} = VllmBridge.Pool.workers(:one)
    {group, 0} = System.cmd("ps", ["-o", "comm=", "-g", to_string(w.os_pid)])
    IO.puts("READY " <> System.pid() <> " " <> Enum.join(String.split(group), ","))
    System.halt(0)
    """

    port =
      open_beam([System.find_executable("unshare"), "-Urpf", "--mount-proc"], script, [python])

    assert ["1", group] = read_ready(port, "") |> String.split()
    assert_receive {^port, {:exit_status, 0}}, 30_000
    # The interpreter alone in its group: no sentinel was asked for.
    assert [comm] = String.split(group, ",")
    assert comm != "vllm-bridge-snt"
  end

  # A BEAM of its own on a port: `elixir -e script -- argv` with this build's code,
  # run by `prefix` when it is not empty (a command that runs the rest, as `unshare`
  # does). Its lines are read by read_ready/2.
  defp open_beam(prefix, script, argv) do
    ebin = Path.join([Mix.Project.build_path(), "lib", "vllm_bridge", "ebin"])
    elixir = [System.find_executable("elixir"), "-pa", ebin, "-e", script, "--" | argv]
    [exe | args] = prefix ++ elixir

    Port.open({:spawn_executable, exe}, [
      :binary,
      :exit_status,
      :stderr_to_stdout,
      {:line, 4096},
      args: args
    ])
  end

  defp read_ready(port, seen) do
    receive do
      {^port, {:data, {:eol, "READY " <> pids}}} ->
        pids

      {^port, {:data, {_, line}}} ->
        read_ready(port, seen <> line <> "\n")

      {^port, {:exit_status, status}} ->
        flunk("the BEAM exited with status #{status} before it was ready:\n#{seen}")
    after
      120_000 -> flunk("the BEAM was not ready within 120 s:\n#{seen}")
    end
  end
end
