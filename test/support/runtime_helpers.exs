defmodule VllmBridge.RuntimeHelpers do
  @moduledoc false
  # Helpers for the runtime tests (test/runtime): waiting for a condition, OS processes.

  alias VllmBridge.Pool
  alias VllmBridge.Pool.Slots

  @doc "Polls `fun` until it returns a truthy value (returned) or `ms` pass (flunks)."
  def wait_until(fun, ms \\ 30_000, what \\ "condition") do
    deadline = System.monotonic_time(:millisecond) + ms
    do_wait(fun, deadline, ms, what)
  end

  defp do_wait(fun, deadline, ms, what) do
    case fun.() do
      result when result not in [nil, false] ->
        result

      _ ->
        if System.monotonic_time(:millisecond) > deadline do
          ExUnit.Assertions.flunk("#{what} did not hold within #{ms} ms")
        else
          Process.sleep(10)
          do_wait(fun, deadline, ms, what)
        end
    end
  end

  @doc """
  The serving workers of a pool, waiting until all of them serve. The list returned is
  the one seen whole: a second look after `Pool.await_ready/2` could find a worker that
  went down in between (a test that just killed one) as nil.
  """
  def workers!(pool) do
    wait_until(
      fn ->
        case Pool.workers(pool) do
          {:ok, ws} -> if Enum.all?(ws, & &1), do: ws
          _ -> nil
        end
      end,
      60_000,
      "every worker of pool #{inspect(pool)} serving"
    )
  end

  @doc """
  Waits until pool `pool` serves with nothing in flight on any worker and nobody queued;
  returns `{workers, meta}` (each test of a pool starts from there).
  """
  def await_idle!(pool) do
    ws = workers!(pool)
    {:ok, meta} = Pool.meta(pool)

    wait_until(fn ->
      Enum.all?(ws, &(Slots.load(meta, &1.index) == 0)) and Slots.waiting(meta) == 0
    end)

    {ws, meta}
  end

  @shm_killed_at {__MODULE__, :shm_killed_at}

  @doc """
  Waits until `restart_shm!/0` may kill `VllmBridge.Shm` at once (2.5 s after the last
  kill): for a test that must not wait between its set-up and the kill.
  """
  def pace_shm_restart do
    # (Monotonic time may be negative: no "long ago" default.)
    case :persistent_term.get(@shm_killed_at, nil) do
      nil -> :ok
      at -> Process.sleep(max(at + 2_500 - System.monotonic_time(:millisecond), 0))
    end
  end

  @doc """
  Kills `VllmBridge.Shm` and waits for its successor (its pid). Restarts are spaced at
  least 2.5 s apart, across the test modules that call this: its supervisor allows 3 in
  5 s, counted in whole seconds (four 1.7 s apart fell in one period), and a 4th would
  take the directory's keeper down with it.
  """
  def restart_shm! do
    pace_shm_restart()
    old = Process.whereis(VllmBridge.Shm)
    ref = Process.monitor(old)
    Process.exit(old, :kill)
    :persistent_term.put(@shm_killed_at, System.monotonic_time(:millisecond))

    receive do
      {:DOWN, ^ref, :process, ^old, :killed} -> :ok
    after
      5_000 -> raise "VllmBridge.Shm (#{inspect(old)}) did not die"
    end

    wait_until(fn -> Process.whereis(VllmBridge.Shm) not in [nil, old] end, 5_000, "Shm restarts")
    Process.whereis(VllmBridge.Shm)
  end

  @doc """
  The OS processes (pids as strings), other than this BEAM, of which an argument of the
  command line or the target of an open fd satisfies `match`: what holds or names a
  FIFO or a file (a shell given its path, a `cat` that has it open), orphans included.
  """
  def path_holders(match) do
    beam = System.pid()

    for dir <- File.ls!("/proc"),
        dir =~ ~r/^\d+$/,
        dir != beam,
        names_path?(dir, match) or holds_path?(dir, match),
        do: dir
  end

  defp names_path?(dir, match) do
    case File.read("/proc/#{dir}/cmdline") do
      {:ok, cmd} -> cmd |> String.split(<<0>>) |> Enum.any?(match)
      _ -> false
    end
  end

  defp holds_path?(dir, match) do
    case File.ls("/proc/#{dir}/fd") do
      {:ok, fds} ->
        Enum.any?(fds, fn fd ->
          case File.read_link("/proc/#{dir}/fd/#{fd}") do
            {:ok, target} -> match.(target)
            _ -> false
          end
        end)

      _ ->
        false
    end
  end

  @doc "A float32 tensor of `mib` MiB, every element `seed` (large enough for a slot)."
  def filled_tensor(mib, seed) do
    n = div(mib * 1_048_576, 4)
    VllmBridge.Tensor.new(:binary.copy(<<seed + 0.0::little-float-32>>, n), :float32, [n])
  end

  @doc "The output readers linked to a worker process (VllmBridge.Worker.Output)."
  def output_readers(worker) do
    {:links, links} = Process.info(worker, :links)

    for pid <- links,
        is_pid(pid),
        {:dictionary, d} = Process.info(pid, :dictionary),
        d[:"$initial_call"] == {VllmBridge.Worker.Output, :init, 1},
        do: pid
  end

  @doc "Whether worker `w` runs a request now (its Python side says so)."
  def running?(w),
    do: match?({:ok, %{"running" => id}} when is_integer(id), VllmBridge.Worker.ping(w))

  @doc """
  Whether worker `w` (index 0 of the pool with `meta`) is idle: no slot taken, nothing in
  its table, nothing running or queued on the Python side.
  """
  def worker_idle?(w, meta) do
    Slots.load(meta, 0) == 0 and VllmBridge.Worker.in_flight(w) == 0 and
      match?({:ok, %{"running" => nil, "queued" => 0}}, VllmBridge.Worker.ping(w))
  end

  @doc "Whether an OS process is alive (and not a zombie)."
  def os_alive?(os_pid), do: VllmBridge.Worker.OsProcess.alive?(os_pid)

  @doc """
  Has the OS process `pid` killed after the test, if it is still that very process (by
  its start time: its pid may be another's by then); its `{pid, start}`, nil when it is
  gone already.
  """
  def kill_after_test(pid) do
    with {^pid, start} = ident <- VllmBridge.Worker.OsProcess.ident(pid) do
      ExUnit.Callbacks.on_exit(fn -> VllmBridge.Worker.OsProcess.kill(pid, start) end)
      ident
    end
  end

  @doc """
  A python3 on a port (`:line` mode) with 256 MiB written and 8 threads asleep, that
  ignores EOF and is killed after the test: `{port, os_pid}` once it is ready. What a
  worker with torch is to a kill: its exit takes tens of ms, run by whichever thread
  ends last. (Its line in one write: a second write after the port closed would end it
  by a broken pipe.)
  """
  def threaded_python! do
    code =
      "import os, threading, time; x = b'\\1' * (256 << 20)\n" <>
        "for _ in range(8): threading.Thread(target=time.sleep, args=(60,)).start()\n" <>
        "os.write(1, b'ready\\n'); time.sleep(60)"

    python = System.find_executable("python3")
    port = Port.open({:spawn_executable, python}, [:binary, line: 64, args: ["-c", code]])
    {:os_pid, os_pid} = Port.info(port, :os_pid)
    kill_after_test(os_pid)

    receive do
      {^port, {:data, {:eol, "ready"}}} -> {port, os_pid}
    after
      30_000 -> raise "the threaded python3 (os pid #{os_pid}) not ready within 30 s"
    end
  end

  @doc "The thread count of an OS process (/proc/<pid>/status), nil when it is gone."
  def os_threads(os_pid) do
    with {:ok, text} <- File.read("/proc/#{os_pid}/status"),
         [_, n] <- Regex.run(~r/^Threads:\s+(\d+)$/m, text),
         do: String.to_integer(n),
         else: (_ -> nil)
  end

  @doc "The absolute path of test/support (for PYTHONPATH)."
  def support_dir, do: Path.expand(".", __DIR__)

  @doc "The Python tests' support modules' folder (cancel_support, ...), for PYTHONPATH."
  def python_support_dir, do: Path.expand("../../python/tests/bridge", __DIR__)

  @doc """
  A `worker_env` entry putting `dirs` first on the worker's PYTHONPATH, whatever the
  environment's PYTHONPATH already holds after them.
  """
  def python_path(dirs),
    do: {"PYTHONPATH", Enum.join(dirs ++ List.wrap(System.get_env("PYTHONPATH")), ":")}

  @doc """
  Occupies one slot of a worker until `unhold/1`: a task enumerating a slow stream (one
  chunk every 20 ms). Returns once the pool's load has gone up by one, i.e. the slot is
  taken (a worker runs one call at a time, so a stream pipelined behind another is queued
  in Python and sends no chunk until the one before it ends). Unhold in the order held.
  """
  def hold(opts \\ []) do
    pool = Keyword.get(opts, :pool_name, :default)
    before = total_load(pool)

    task =
      Task.async(fn ->
        {:ok, s} =
          VllmBridge.stream({"vllm_bridge.bridge.diag", "count"}, [1_000_000, 0.02], %{}, opts)

        Enum.reduce_while(s, :more, fn _x, _acc ->
          receive do
            :release -> {:halt, :released}
          after
            0 -> {:cont, :more}
          end
        end)
      end)

    wait_until(fn -> total_load(pool) > before end, 60_000, "hold/1: the slot taken")
    task
  end

  @doc "The sum of the loads of a pool's serving workers."
  def total_load(pool) do
    {:ok, ws} = Pool.workers(pool)
    ws |> Enum.reject(&is_nil/1) |> Enum.map(& &1.load) |> Enum.sum()
  end

  @doc "Ends a `hold/1` (the stream is cancelled); returns how it ended."
  def unhold(task) do
    send(task.pid, :release)
    Task.await(task, 30_000)
  end

  @doc "Whether `device` is a worker's device as its hello gives it: \"cpu\" or \"cuda:N\"."
  def device?(device), do: device == "cpu" or (is_binary(device) and device =~ ~r/^cuda:\d+$/)

  @doc """
  A `python:` wrapper, a shell script in the folder `tmp`, that runs `line` (a shell
  line: `unset VLLM_BRIDGE_SHM_DIR`, say) and then the interpreter; its path.
  """
  def python_wrapper(tmp, line), do: wrapper_script(tmp, &"#{line}\nexec #{&1}")

  @doc """
  A `python:` wrapper, a shell script in the folder `tmp` whose body is `body.(run)`,
  `run` the shell words that run the interpreter with the wrapper's arguments; its path.
  """
  def wrapper_script(tmp, body) do
    path = Path.join(tmp, "python-#{System.unique_integer([:positive])}.sh")
    python = Application.fetch_env!(:vllm_bridge, :python)
    File.write!(path, "#!/bin/sh\n#{body.(~s(#{python} "$@"))}\n")
    File.chmod!(path, 0o755)
    path
  end

  @doc """
  A one-worker pool named `prefix` plus a unique number, its Python modules `allow`ed
  from test/support, whose worker keeps unread result slots and idle slot buffers for an
  hour (`VLLM_BRIDGE_SHM_RECLAIM_S`, `VLLM_BRIDGE_SHM_IDLE_S`): a test sees each slot
  only as the code under test hands it back. Returns `{name, worker}` once it serves.
  """
  def slot_keeping_pool!(prefix, allow) do
    name = :"#{prefix}_#{System.unique_integer([:positive])}"

    start_pool!(name,
      size: 1,
      allow: allow,
      worker_env: [
        python_path([support_dir()]),
        {"VLLM_BRIDGE_SHM_RECLAIM_S", "3600"},
        {"VLLM_BRIDGE_SHM_IDLE_S", "3600"}
      ]
    )

    [w] = workers!(name)
    {name, w}
  end

  @doc "Starts a pool for a test module and stops it when the module is done."
  def start_pool!(name, opts) do
    {:ok, _} = VllmBridge.start_pool(name, opts)
    ExUnit.Callbacks.on_exit(fn -> VllmBridge.stop_pool(name) end)
    name
  end
end
