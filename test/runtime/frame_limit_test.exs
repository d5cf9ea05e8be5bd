defmodule VllmBridge.Runtime.FrameLimitTest do
  @moduledoc """
  The frame limit on the Elixir side (`max_frame_bytes`): a worker whose Python process
  sends a header declaring 4 GiB does not grow the BEAM, its calls get `:worker_exit`
  naming the length and the limit, and the pool restarts it (a fake worker,
  test/support/runtime_fake_worker.py); a request over the limit is `:bad_argument`
  naming its size and the limit, with nothing reserved or left in flight, whichever way
  it is sent, and the worker serves on; a reply over it is the worker's error.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import Bitwise, only: [<<<: 2]
  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Pool, Worker}
  alias VllmBridge.Pool.Slots

  @limit 65_536

  setup_all do
    start_pool!(:rt_limit, size: 1, max_frame_bytes: @limit, allow: ["vllm_bridge.bridge.diag"])
    :ok
  end

  defp fake_env(mode, extra \\ []),
    do: [{"PYTHONPATH", support_dir()}, {"FAKE_WORKER_MODE", mode} | extra]

  describe "a header over the limit from the worker" do
    test "4 GiB declared: the BEAM does not grow, calls get :worker_exit, the pool restarts it" do
      start_pool!(:rt_huge,
        size: 1,
        worker_module: "runtime_fake_worker",
        worker_env: fake_env("huge_header")
      )

      [%{os_pid: first}] = workers!(:rt_huge)
      :erlang.garbage_collect()
      total = :erlang.memory(:total)
      binary = :erlang.memory(:binary)

      # The fake reads both requests, then answers with the header.
      for call <- two_calls(:rt_huge) do
        assert {:error, %Error{type: :worker_exit, message: msg}} = Task.await(call, 90_000)
        assert msg =~ "declaring 4294967295 bytes, over the limit of 1073741824 bytes"
        assert msg =~ "max_frame_bytes"
      end

      # Nothing like the declared length was allocated.
      assert :erlang.memory(:total) - total < 64 <<< 20
      assert :erlang.memory(:binary) - binary < 64 <<< 20
      restarted!(:rt_huge, first)
    end

    test "replies in the same chunk before it reach their callers; then the worker is killed" do
      start_pool!(:rt_huge_after,
        size: 1,
        worker_module: "runtime_fake_worker",
        worker_env: fake_env("huge_header", [{"FAKE_WORKER_ANSWER", "1"}])
      )

      [%{os_pid: first}] = workers!(:rt_huge_after)

      # The fake reads both requests, then writes both replies and the header at once.
      for call <- two_calls(:rt_huge_after),
          do: assert({:ok, "answered"} = Task.await(call, 90_000))

      restarted!(:rt_huge_after, first)
    end

    # Two calls in flight at once on the pool's only worker.
    defp two_calls(pool) do
      for i <- 1..2 do
        Task.async(fn ->
          VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [i, 1], %{},
            pool_name: pool,
            timeout: 60_000
          )
        end)
      end
    end

    # The Python process `first` was killed, and a new one serves in its place.
    defp restarted!(pool, first) do
      wait_until(fn -> not os_alive?(first) end)
      wait_until(fn -> match?({:ok, [%{os_pid: p}]} when p != first, Pool.workers(pool)) end)
    end

    test "a worker that announces another limit than it was given is refused at its hello" do
      assert {:error, %Error{type: :protocol, message: msg}} =
               VllmBridge.start_pool(:rt_limit_lie,
                 worker_module: "runtime_fake_worker",
                 worker_env: fake_env("limit")
               )

      assert msg =~ "announced max_frame_bytes 12345, but was started with 1073741824"
    end
  end

  describe "requests and replies over the limit" do
    setup do
      {[w], meta} = await_idle!(:rt_limit)
      %{w: w, meta: meta}
    end

    defp echo(value, opts \\ []),
      do:
        VllmBridge.call(
          {"vllm_bridge.bridge.diag", "echo"},
          [value],
          %{},
          [pool_name: :rt_limit] ++ opts
        )

    test "the worker is told the limit and announces it", %{w: w} do
      assert Worker.hello(w.pid)["max_frame_bytes"] == @limit
      args = "/proc/#{w.os_pid}/cmdline" |> File.read!() |> String.split(<<0>>, trim: true)
      assert Enum.take(args, -2) == ["--max-frame-bytes", "65536"]
    end

    test "a call over the limit is :bad_argument naming its size and the limit; nothing leaks",
         %{w: w, meta: meta} do
      big = :binary.copy("x", 70_000)
      assert {:error, %Error{type: :bad_argument, message: msg}} = echo(big)
      assert [_, size] = Regex.run(~r/frame would be (\d+) bytes/, msg)
      assert String.to_integer(size) > 70_000
      assert msg =~ "over the frame limit of 65536 bytes (max_frame_bytes of pool :rt_limit)"

      # In a session, bound to a reference, or as a stream: the same, before anything is
      # reserved.
      {:ok, s} = VllmBridge.Session.open(pool_name: :rt_limit)
      assert {:error, %Error{type: :bad_argument}} = echo(big, session_id: s.id)

      {:ok, ref} =
        VllmBridge.call({"vllm_bridge.bridge.diag", "opaque"}, [0], %{}, pool_name: :rt_limit)

      assert {:error, %Error{type: :bad_argument}} =
               VllmBridge.call({ref, "bump"}, [big], %{}, pool_name: :rt_limit)

      {:ok, stream} =
        VllmBridge.stream({"vllm_bridge.bridge.diag", "count"}, [big], %{}, pool_name: :rt_limit)

      assert %Error{type: :bad_argument} = catch_error(Enum.to_list(stream))
      :ok = VllmBridge.Session.close(s)

      assert Slots.load(meta, 0) == 0 and Slots.waiting(meta) == 0
      assert Worker.in_flight(w.pid) == 0
      # The same Python process serves on, up to the limit.
      just_under = :binary.copy("y", 65_000)
      assert {:ok, ^just_under} = echo(just_under)
      assert [%{os_pid: os_pid}] = workers!(:rt_limit)
      assert os_pid == w.os_pid
    end

    test "a request sent around the pool's check is refused by the worker process",
         %{w: w, meta: meta} do
      big = :binary.copy("x", 70_000)

      assert {:error, %Error{type: :bad_argument, message: msg}} =
               Worker.call(w.pid, "vllm_bridge.bridge.diag", "echo", [big])

      assert msg =~ "over the frame limit of 65536 bytes (max_frame_bytes)"
      assert Worker.in_flight(w.pid) == 0 and Slots.load(meta, 0) == 0
      assert {:ok, %{"running" => nil}} = Worker.ping(w.pid)
      assert {:ok, 3} = Worker.call(w.pid, "vllm_bridge.bridge.diag", "add", [1, 2])
      assert Worker.os_pid(w.pid) == w.os_pid
    end

    test "a request of 4 GiB or more is refused before it is framed, and nothing is written",
         %{w: w, meta: meta} do
      # 64 references to one 64 MiB binary (0xFF bytes: nothing a reader could take for a
      # small header): a body of 4 GiB and a few hundred bytes, 64 MiB in memory. Its
      # length does not fit the 4-byte header: wrapped, it would read as a few hundred.
      big = :binary.copy(<<0xFF>>, 64 <<< 20)
      args = [List.duplicate(big, 64)]

      assert {:error, %Error{type: :bad_argument, message: msg}} =
               Worker.call(w.pid, "vllm_bridge.bridge.diag", "echo", args, %{}, 60_000)

      assert [_, size] = Regex.run(~r/frame would be (\d+) bytes/, msg)
      assert String.to_integer(size) > 1 <<< 32
      assert msg =~ "over the frame limit of 65536 bytes (max_frame_bytes)"

      # Through the pool: refused before a slot is reserved, as any request over the limit.
      assert {:error, %Error{type: :bad_argument}} =
               VllmBridge.call({"vllm_bridge.bridge.diag", "echo"}, args, %{},
                 pool_name: :rt_limit
               )

      # The same Python process serves on; nothing was left in flight.
      assert Worker.in_flight(w.pid) == 0 and Slots.load(meta, 0) == 0
      assert {:ok, 3} = Worker.call(w.pid, "vllm_bridge.bridge.diag", "add", [1, 2])
      assert Worker.os_pid(w.pid) == w.os_pid
    end

    test "a reply over the limit is the worker's error, naming its size and the limit", %{w: w} do
      {:ok, ref} =
        VllmBridge.call({"vllm_bridge.bridge.diag", "opaque"}, [:binary.copy("a", 40_000)], %{},
          pool_name: :rt_limit
        )

      # value + by: 70 000 bytes, over 64 KiB on the way back.
      assert {:error, %Error{type: :python_exception, python_type: "ValueError", message: msg}} =
               VllmBridge.call({ref, "bump"}, [:binary.copy("b", 30_000)], %{},
                 pool_name: :rt_limit
               )

      assert msg =~
               ~r/a reply of \d+ bytes \(its result slots' data counted\) exceeds the frame limit of 65536 bytes/

      assert {:ok, 3} =
               VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [1, 2], %{},
                 pool_name: :rt_limit
               )

      assert Worker.os_pid(w.pid) == w.os_pid
    end

    test "max_frame_bytes out of range is refused by name" do
      for bad <- [1_000, 1 <<< 32, :big] do
        assert {:error, %Error{type: :bad_argument, message: msg}} =
                 VllmBridge.start_pool(:rt_limit_bad, max_frame_bytes: bad)

        assert msg =~ "pool option max_frame_bytes"
      end
    end
  end
end
