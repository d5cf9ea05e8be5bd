defmodule VllmBridge.Runtime.WorkerTest do
  @moduledoc """
  One worker process and its port: the handshake (version check, start timeout, a worker
  that dies before it), `log` frames, `ping` while a call runs, and a Python process that
  dies with calls in flight.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import ExUnit.CaptureLog
  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Pool, Worker}

  setup_all do
    {:ok, w} = Worker.start_link(cancel_grace: 60_000)
    {:ok, hello} = Worker.await_ready(w)
    # It stops, with its Python process, when this process (its owner) exits.
    %{w: w, hello: hello}
  end

  defp fake(mode, extra \\ []) do
    [
      worker_module: "runtime_fake_worker",
      worker_env: [{"PYTHONPATH", support_dir()}, {"FAKE_WORKER_MODE", mode}]
    ] ++ extra
  end

  describe "handshake" do
    test "a worker speaking another protocol version is refused by name" do
      assert {:error, %Error{type: :protocol, message: msg}} =
               VllmBridge.start_pool(:fake_version, fake("version"))

      assert msg =~ "protocol version 99"
      assert msg =~ ":fake_version"
      assert Pool.names() |> Enum.member?(:fake_version) == false
    end

    test "a worker that never says hello fails after start_timeout" do
      assert {:error, %Error{type: :worker_exit, message: msg}} =
               VllmBridge.start_pool(:fake_silent, fake("silent", start_timeout: 300))

      assert msg =~ "no handshake within 300 ms"
    end

    test "a worker that exits before its handshake is reported with its status" do
      assert {:error, %Error{type: :worker_exit, message: msg}} =
               VllmBridge.start_pool(:fake_crash, fake("crash"))

      assert msg =~ "exited with status 3 before its handshake"
    end

    test "a caller that gives up while its worker starts is answered then, not after the start" do
      {:ok, w} =
        Worker.start_link(
          worker_module: "runtime_fake_worker",
          env: [{"PYTHONPATH", support_dir()}, {"FAKE_WORKER_MODE", "silent"}],
          start_timeout: 600_000
        )

      # The handshake never comes (the fake stays silent): both wait for it, and give up
      # at their deadlines without it.
      assert {:error, %Error{type: :timeout}} = Worker.ping(w, 50)

      assert {:error, %Error{type: :timeout}} =
               Worker.call(w, "vllm_bridge.bridge.diag", "add", [1, 2], %{}, 50)

      assert Process.alive?(w)
      Process.unlink(w)
      Process.exit(w, :kill)
    end

    test "a call given up while its worker starts is dropped, never run later" do
      {:ok, w} = Worker.start_link()

      assert {:error, %Error{type: :timeout}} =
               Worker.call(w, "vllm_bridge.bridge.diag", "set_var", ["ghost"], %{}, 1)

      assert {:ok, _} = Worker.await_ready(w)
      assert {:ok, nil} = Worker.call(w, "vllm_bridge.bridge.diag", "get_var", [], %{}, 30_000)
      assert Worker.in_flight(w) == 0
      Worker.close(w)
    end

    test "frames in the hello's chunk, and a header cut right after them, are read in order" do
      log =
        capture_log(fn ->
          {:ok, w} = Worker.start_link(fake("hello_chunk") |> fake_env())
          assert {:ok, _hello} = Worker.await_ready(w)
          # Served after both records (the second one's header came cut in two).
          assert {:ok, "served"} = Worker.call(w, "m", "f", [], %{}, 30_000)
          assert {:ok, "served"} = Worker.call(w, "m", "f", [], %{}, 30_000)
          Logger.flush()
          Worker.close(w)
        end)

      assert [_, after_first] = String.split(log, "[python fake] first", parts: 2)
      assert after_first =~ "[python fake] second"
    end

    test "a missing interpreter is a bad argument naming it" do
      assert {:error, %Error{type: :bad_argument, message: msg}} =
               VllmBridge.start_pool(:no_python, python: "/nonexistent/python3")

      assert msg =~ "/nonexistent/python3"
    end
  end

  describe "a running worker" do
    test "the hello carries version, pid, instance, capabilities and modules", %{hello: hello} do
      assert hello["protocol"] == 1
      assert hello["instance"] =~ ~r/^[0-9a-f]{16}$/
      assert "cancel" in hello["capabilities"] and "stream" in hello["capabilities"]
      # The flow control of streams: both sides use the same window.
      assert "credit" in hello["capabilities"]
      assert hello["stream_window"] == VllmBridge.Stream.window()
      assert "vllm_bridge.bridge.diag" in hello["modules"]
    end

    test "Python log records arrive in Logger with the logger's name", %{w: w} do
      log =
        capture_log(fn ->
          assert {:ok, nil} =
                   Worker.call(w, "vllm_bridge.bridge.diag", "log", ["disk almost full", "error"])

          # The log frame precedes the reply on the wire, but Logger is asynchronous.
          Logger.flush()
        end)

      assert log =~ "[python vllm_bridge.bridge.diag] disk almost full"
    end

    test "ping is answered while a call runs, naming it", %{w: w} do
      task = Task.async(fn -> Worker.call(w, "vllm_bridge.bridge.diag", "sleep", [0.5]) end)

      status =
        wait_until(fn ->
          case Worker.ping(w) do
            {:ok, %{"running" => id} = s} when is_integer(id) -> s
            _ -> nil
          end
        end)

      assert status["queued"] == 0
      assert Task.await(task) == {:ok, 0.5}
      assert {:ok, %{"running" => nil}} = Worker.ping(w)
    end
  end

  describe "a port that fails (the Python process stops reading)" do
    # The fake closes its fd 3 after its hello; a write to the port then fails (EPIPE).
    defp deaf!(os_pid),
      do: wait_until(fn -> not File.exists?("/proc/#{os_pid}/fd/3") end, 30_000, "fd 3 closed")

    test "a standalone worker tells its caller why, then stops" do
      Process.flag(:trap_exit, true)
      {:ok, w} = Worker.start_link(fake("deaf") |> fake_env())
      {:ok, %{"pid" => os_pid}} = Worker.await_ready(w)
      deaf!(os_pid)

      # The caller gets its :worker_exit (it is not taken down by the port's failure).
      assert {:error, %Error{type: :worker_exit, message: msg}} =
               Worker.call(w, "vllm_bridge.bridge.diag", "add", [1, 2], %{}, 30_000)

      assert msg =~ "the port to the Python process (os pid #{os_pid}) failed (:epipe)"
      assert_receive {:EXIT, ^w, {:shutdown, {:worker_exit, ^msg}}}, 30_000
      wait_until(fn -> not os_alive?(os_pid) end)
    end

    test "a pool's worker tells its callers why, and the pool starts it again" do
      start_pool!(:fake_deaf, fake("deaf"))
      [%{os_pid: os_pid}] = workers!(:fake_deaf)
      deaf!(os_pid)

      assert {:error, %Error{type: :worker_exit, message: msg}} =
               VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [1, 2], %{},
                 pool_name: :fake_deaf,
                 timeout: 30_000
               )

      assert msg =~ "failed (:epipe)"
      wait_until(fn -> not os_alive?(os_pid) end)

      wait_until(fn ->
        match?({:ok, [%{os_pid: p}]} when p != os_pid, Pool.workers(:fake_deaf))
      end)
    end
  end

  test "a standalone worker stops with its owner, however the owner ends, and so does its Python process" do
    for ending <- [:normal, :kill, :shutdown] do
      me = self()

      owner =
        spawn(fn ->
          {:ok, w} = Worker.start_link()
          send(me, {:started, w, Worker.os_pid(w)})

          receive do
            :end -> exit(:normal)
          end
        end)

      assert_receive {:started, w, os_pid}, 90_000
      mon = Process.monitor(w)
      if ending == :normal, do: send(owner, :end), else: Process.exit(owner, ending)

      assert_receive {:DOWN, ^mon, :process, ^w, _}, 30_000
      wait_until(fn -> not os_alive?(os_pid) end, 30_000, "the Python process gone (#{ending})")
    end
  end

  # Pool options of a fake as the options of a worker of its own.
  defp fake_env(opts) do
    {env, opts} = Keyword.pop(opts, :worker_env)
    Keyword.put(opts, :env, env)
  end

  test "when the Python process dies, every call in flight gets :worker_exit" do
    Process.flag(:trap_exit, true)
    {:ok, w} = Worker.start_link()
    os_pid = Worker.os_pid(w)
    parent = self()

    tasks =
      for s <- [30, 31, 32] do
        Task.async(fn ->
          send(parent, :sent)
          Worker.call(w, "vllm_bridge.bridge.diag", "sleep", [s], %{}, 60_000)
        end)
      end

    for _ <- tasks, do: assert_receive(:sent)
    wait_until(fn -> Worker.in_flight(w) == 3 end)
    System.cmd("kill", ["-9", "#{os_pid}"])

    for t <- tasks do
      assert {:error, %Error{type: :worker_exit, message: msg}} = Task.await(t)
      assert msg =~ "exited with status"
    end

    assert_receive {:EXIT, ^w, {:shutdown, {:worker_exit, _}}}
  end
end
