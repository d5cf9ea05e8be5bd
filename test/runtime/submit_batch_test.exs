defmodule VllmBridge.Runtime.SubmitBatchTest do
  @moduledoc """
  Requests that reach a worker process together are written to its port in one command
  (VllmBridge.Worker): the worker process is suspended while callers send, so that every
  request is in its mailbox when it resumes. Each request is answered as if alone
  (refused ones inside the burst included), one caller's requests run in the order it
  sent them, and the burst costs one port write (a call trace of the worker process's
  `:erlang.port_command/2`).
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Call.{Request, Wire}
  alias VllmBridge.Error
  alias VllmBridge.Pool.Directory
  alias VllmBridge.Worker

  @diag "vllm_bridge.bridge.diag"
  @max_frame 65_536

  setup do
    start_pool!(:rt_batch, size: 1, max_in_flight: 64, max_frame_bytes: @max_frame, allow: [@diag])

    await_idle!(:rt_batch)
    {pid, _} = Directory.worker(:rt_batch, 0)
    :erlang.trace_pattern({:erlang, :port_command, 2}, true, [:global])

    on_exit(fn ->
      :erlang.trace_pattern({:erlang, :port_command, 2}, false, [:global])
      if Process.alive?(pid), do: :sys.resume(pid)
    end)

    %{worker: pid}
  end

  # Suspends the worker process, runs `send_all` (which sends `n` requests and returns
  # what is needed to await them), waits until all `n` are in its mailbox, then resumes
  # it traced: `{what send_all returned, port writes the worker made while it took the
  # burst}`.
  defp burst(worker, n, send_all) do
    :ok = :sys.suspend(worker)
    waiting = send_all.()

    wait_until(fn -> requests_queued(worker) >= n end, 30_000, "#{n} requests queued")

    1 = :erlang.trace(worker, true, [:call])
    :ok = :sys.resume(worker)
    {waiting, worker}
  end

  # Requests in the worker's mailbox (its sweep's timer may be there too).
  defp requests_queued(worker) do
    {:messages, messages} = Process.info(worker, :messages)
    Enum.count(messages, &match?({:"$vb_req", _}, &1))
  end

  # The port writes the worker made up to now (its trace flag then off).
  defp writes(worker) do
    :erlang.trace(worker, false, [:call])
    ref = :erlang.trace_delivered(worker)
    assert_receive {:trace_delivered, ^worker, ^ref}, 10_000
    count_writes(worker, 0)
  end

  defp count_writes(worker, n) do
    receive do
      {:trace, ^worker, :call, {:erlang, :port_command, _}} -> count_writes(worker, n + 1)
    after
      0 -> n
    end
  end

  test "a burst of callers: each answered, refused ones too, in one port write", %{worker: w} do
    too_big = :binary.copy("x", @max_frame + 1)

    {tasks, _} =
      burst(w, 45, fn ->
        for i <- 1..45 do
          # One in nine is over the worker's frame limit: refused by the worker process,
          # inside the burst, without a write.
          arg = if rem(i, 9) == 0, do: too_big, else: i
          Task.async(fn -> {i, Worker.call(w, @diag, "echo", [arg], %{}, 60_000)} end)
        end
      end)

    for {i, result} <- Task.await_many(tasks, 60_000) do
      if rem(i, 9) == 0 do
        assert {:error, %Error{type: :bad_argument, message: message}} = result
        assert message =~ "over the frame limit of #{@max_frame} bytes"
      else
        assert result == {:ok, i}
      end
    end

    assert writes(w) == 1
    assert Worker.in_flight(w) == 0
  end

  test "requests queued behind the port's exit are answered with why the worker went",
       %{worker: w} do
    # The Python process is killed while the worker process is suspended with a request
    # in its mailbox; a second request comes after the port's exit_status. The port is
    # closed when they are taken: their writes take nothing, and the exit answers both.
    port = :sys.get_state(w).port
    mon = Process.monitor(w)
    os_pid = Worker.os_pid(w)
    :ok = :sys.suspend(w)
    first = Task.async(fn -> Worker.call(w, @diag, "echo", [1], %{}, 30_000) end)
    wait_until(fn -> requests_queued(w) == 1 end, 30_000, "the first request queued")
    {_, 0} = System.cmd("kill", ["-9", "#{os_pid}"])

    wait_until(
      fn ->
        {:messages, messages} = Process.info(w, :messages)
        Enum.any?(messages, &match?({^port, {:exit_status, _}}, &1))
      end,
      30_000,
      "the port's exit_status queued"
    )

    second = Task.async(fn -> Worker.call(w, @diag, "echo", [2], %{}, 30_000) end)
    wait_until(fn -> requests_queued(w) == 2 end, 30_000, "the second request queued")
    :ok = :sys.resume(w)

    for task <- [first, second] do
      assert {:error, %Error{type: :worker_exit, message: message}} = Task.await(task, 30_000)
      assert message =~ "exit", message
      refute message =~ "badarg", message
    end

    assert_receive {:DOWN, ^mon, :process, ^w, reason}, 30_000
    refute match?({:badarg, _}, reason), inspect(reason, limit: 6)
  end

  test "behind a long mailbox, requests are written one by one, each answered", %{worker: w} do
    # 300 messages that are no requests behind 5 requests: a request taken then would
    # walk them all to find the next request, so each is written alone.
    {tasks, _} =
      burst(w, 5, fn ->
        tasks = for i <- 1..5, do: Task.async(fn -> Worker.call(w, @diag, "echo", [i]) end)
        wait_until(fn -> requests_queued(w) == 5 end, 30_000, "5 requests queued")
        for _ <- 1..300, do: send(w, :not_a_request)
        tasks
      end)

    assert Task.await_many(tasks, 60_000) == for(i <- 1..5, do: {:ok, i})
    assert writes(w) == 5
  end

  test "one caller's requests in a burst run in the order it sent them", %{worker: w} do
    request = fn name, args ->
      {:ok, parts} = Wire.encode_invoke({@diag, name}, args, %{})
      Request.new("call", pre: [Wire.value(nil)], post: parts)
    end

    {handles, _} =
      burst(w, 40, fn ->
        for i <- 1..20 do
          set = Request.send_request(w, request.("set_var", [i]), :infinity)
          get = Request.send_request(w, request.("get_var", []), :infinity)
          {i, set, get}
        end
      end)

    for {i, set, get} <- handles do
      # Each set_var returns the value before it: the previous pair's.
      assert Request.await(set, :infinity) == {:ok, if(i == 1, do: nil, else: i - 1)}
      assert Request.await(get, :infinity) == {:ok, i}
    end

    assert writes(w) == 1
  end
end
