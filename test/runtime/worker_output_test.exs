defmodule VllmBridge.Runtime.WorkerOutputTest do
  @moduledoc """
  Where a worker's Python logs and output go: records at or above the pool's `log_level`
  reach Logger with the pool, the worker's index, its OS pid and the Python logger's
  name; whatever the worker writes to stdout or stderr (print, sys.stderr, os.write on
  fds 1 and 2, a child process) reaches Logger line by line, attributed to the worker,
  and never the BEAM's own stdout or stderr. Real workers (test/support/rt_output.py).
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Worker.Output

  @pool :rt_output
  @info_pool :rt_output_info

  defp opts(extra) do
    [
      size: 2,
      allow: ["vllm_bridge.bridge.diag", "rt_output"],
      worker_env: [python_path([support_dir()])]
    ] ++ extra
  end

  setup_all do
    start_pool!(@pool, opts([]))
    start_pool!(@info_pool, Keyword.merge(opts([]), size: 1, log_level: :info))
    :ok
  end

  setup do
    %{collector: VllmBridge.LogCollector.attach()}
  end

  defp call(pool, name, args, opts \\ []),
    do: VllmBridge.call({"rt_output", name}, args, %{}, [pool_name: pool] ++ opts)

  # The first logged event whose message contains `text` (waits for it); the events
  # passed over are kept for a later look.
  defp await_log(text, ms \\ 30_000) do
    stash = Process.get(:stash, [])

    case Enum.split_with(stash, fn {_, m, _} -> String.contains?(m, text) end) do
      {[hit | others], rest} ->
        Process.put(:stash, others ++ rest)
        hit

      {[], _} ->
        receive do
          {:log, level, message, meta} ->
            Process.put(:stash, stash ++ [{level, message, meta}])
            await_log(text, ms)
        after
          ms -> flunk("no log line containing #{inspect(text)} within #{ms} ms")
        end
    end
  end

  defp index_of(pool, os_pid) do
    {:ok, ws} = VllmBridge.Pool.workers(pool)
    Enum.find_value(ws, fn w -> w.os_pid == os_pid && w.index end)
  end

  defp unique(prefix), do: "#{prefix}-#{System.unique_integer([:positive])}"

  describe "log_level" do
    test "the default pool forwards warning and above, not info, with the metadata" do
      info = unique("info-record")
      warn = unique("warning-record")
      # One session: both records come from one worker.
      {:ok, s} = VllmBridge.Session.open(pool_name: @pool)
      {:ok, pid} = call(@pool, "log", ["my.lib", "info", info], session_id: s.id)
      {:ok, ^pid} = call(@pool, "log", ["my.lib", "warning", warn], session_id: s.id)

      {level, message, meta} = await_log(warn)
      assert level == :warning
      assert message =~ "[python my.lib]"
      assert meta.vllm_pool == @pool
      assert meta.vllm_worker == index_of(@pool, pid)
      assert meta.os_pid == pid
      assert meta.python_logger == "my.lib"
      # A record after the info one, from the same worker, waited for: had the info
      # record been forwarded, it would be here by now (in the stash or the mailbox).
      sentinel = unique("sentinel")
      {:ok, ^pid} = call(@pool, "log", ["my.lib", "warning", sentinel], session_id: s.id)
      await_log(sentinel)
      refute logged?(info)
    end

    test "a pool at :info forwards info, and still not debug" do
      debug = unique("debug-record")
      info = unique("info-record")
      {:ok, pid} = call(@info_pool, "log", ["other.lib", "debug", debug])
      {:ok, ^pid} = call(@info_pool, "log", ["other.lib", "info", info])

      {level, _message, meta} = await_log(info)
      assert level == :info
      assert {meta.vllm_pool, meta.vllm_worker, meta.os_pid} == {@info_pool, 0, pid}
      # As above: a later record waited for, then the debug one looked for everywhere.
      sentinel = unique("sentinel")
      {:ok, ^pid} = call(@info_pool, "log", ["other.lib", "info", sentinel])
      await_log(sentinel)
      refute logged?(debug)
    end

    test "a bad log_level is refused, naming the value" do
      assert {:error, %VllmBridge.Error{type: :bad_argument, message: m}} =
               VllmBridge.start_pool(:rt_output_bad, log_level: :verbose)

      assert m =~ "log_level"
      assert m =~ ":verbose"
      refute :rt_output_bad in VllmBridge.Pool.names()

      assert {:error, %VllmBridge.Error{message: m}} =
               VllmBridge.start_pool(:rt_output_bad, log_level: "info")

      assert m =~ ~s("info")
    end
  end

  # Whether a record containing `text` was logged: the ones await_log/2 passed over (the
  # stash) and the ones still in the mailbox.
  defp logged?(text) do
    Enum.any?(Process.get(:stash, []), fn {_, m, _} -> String.contains?(m, text) end) or
      Enum.any?(flush_logs(), &String.contains?(&1, text))
  end

  defp flush_logs(acc \\ []) do
    receive do
      {:log, _level, message, _meta} -> flush_logs([message | acc])
    after
      0 -> Enum.reverse(acc)
    end
  end

  defp pool_logs(pool, acc \\ []) do
    receive do
      {:log, _level, message, %{vllm_pool: ^pool}} -> pool_logs(pool, [message | acc])
      {:log, _level, _message, _meta} -> pool_logs(pool, acc)
    after
      0 -> Enum.reverse(acc)
    end
  end

  describe "stdout and stderr" do
    test "print reaches Logger at :info, attributed to its worker" do
      text = unique("printed")
      {:ok, pid} = call(@pool, "say", [text])
      {level, message, meta} = await_log(text)
      assert level == :info
      assert message == "[python stdout] #{text}"
      assert meta.python_stream == :stdout
      assert {meta.vllm_pool, meta.os_pid} == {@pool, pid}
      assert meta.vllm_worker == index_of(@pool, pid)
    end

    test "sys.stderr.write reaches Logger at :warning" do
      text = unique("complained")
      {:ok, pid} = call(@pool, "complain", [text])
      {level, message, meta} = await_log(text)
      assert {level, message} == {:warning, "[python stderr] #{text}"}
      assert {meta.python_stream, meta.os_pid} == {:stderr, pid}
    end

    test "os.write on fds 1 and 2 (as C code writes), several lines at once" do
      a = unique("raw-a")
      b = unique("raw-b")
      {:ok, pid} = call(@pool, "raw", [1, "#{a}\r\n#{b}\n\n"])
      assert {:info, "[python stdout] " <> ^a, %{os_pid: ^pid}} = await_log(a)
      assert {:info, "[python stdout] " <> ^b, %{os_pid: ^pid}} = await_log(b)
      c = unique("raw-c")
      {:ok, pid2} = call(@pool, "raw", [2, c <> "\n"])
      assert {:warning, _, %{python_stream: :stderr, os_pid: ^pid2}} = await_log(c)
      # The empty line after them was not logged (looked for in what passed and what came).
      seen = Enum.map(Process.get(:stash, []), &elem(&1, 1)) ++ flush_logs()
      refute "[python stdout] " in seen
    end

    test "a child process that inherits fds 1 and 2" do
      text = unique("child")
      {:ok, pid} = call(@pool, "child", [text])
      assert {:info, _, %{os_pid: ^pid}} = await_log("[python stdout] #{text}")
      assert {:warning, _, %{os_pid: ^pid}} = await_log(text <> " (err)")
    end

    test "the worker's fds 1 and 2 are not the BEAM's" do
      for %{os_pid: os_pid} <- workers!(@pool), fd <- [1, 2] do
        link = fn -> File.read_link!("/proc/#{os_pid}/fd/#{fd}") end
        # The FIFO its output reader reads, gone from the folder once both ends opened it
        # (a cast at the hello: a worker just (re)started may be ready a moment before).
        wait_until(fn -> link.() =~ "(deleted)" end, 10_000, "fd #{fd}'s FIFO name goes")
        theirs = link.()
        refute theirs == File.read_link!("/proc/#{System.pid()}/fd/1")
        refute theirs == File.read_link!("/proc/#{System.pid()}/fd/2")
        assert theirs =~ "vllm_bridge-out-"
      end
    end

    test "a partial last line is logged when the process ends" do
      text = unique("last-words")
      {:error, %VllmBridge.Error{type: :worker_exit}} = call(@pool, "die_with", [text])
      assert {:warning, "[python stderr] " <> ^text, %{vllm_pool: @pool}} = await_log(text)
      await_idle!(@pool)
    end

    @tag timeout: 300_000
    test "a flood of output does not wedge calls", %{collector: collector} do
      # Not collected here: the test would be the slow reader.
      :ok = :logger.remove_handler(collector)
      task = Task.async(fn -> call(@pool, "flood", [100_000], timeout: 240_000) end)
      # Calls go on while the flood runs (on the other worker, or after it on this one).
      for i <- 1..20 do
        assert {:ok, ^i} =
                 VllmBridge.call({"vllm_bridge.bridge.diag", "echo"}, [i], %{},
                   pool_name: @pool,
                   timeout: 120_000
                 )
      end

      assert {:ok, pid} = Task.await(task, 250_000)
      # The worker that flooded still serves, and its output is still read.
      VllmBridge.LogCollector.attach()
      text = unique("after-flood")
      w = Enum.find(workers!(@pool), &(&1.os_pid == pid))

      {:ok, ^pid} =
        VllmBridge.Worker.call(w.pid, "rt_output", "raw", [1, text <> "\n"], %{}, 120_000)

      assert {:info, _, %{os_pid: ^pid}} = await_only(text, 200_000)
    end
  end

  # Like await_log/2, dropping what passes.
  defp await_only(text, ms) do
    receive do
      {:log, level, message, meta} ->
        if String.contains?(message, text),
          do: {level, message, meta},
          else: await_only(text, ms)
    after
      ms -> flunk("no log line containing #{inspect(text)} within #{ms} ms")
    end
  end

  describe "a reader that dies" do
    test "its worker starts again, and its output is read again" do
      [w | _] = workers!(@pool)
      [reader] = output_readers(w.pid)
      # The readers' `cat`s: each is a child of its reader's shell, the port's process
      # (VllmBridge.Worker.Output).
      shells =
        for {port, _stream} <- :sys.get_state(reader).streams,
            {:os_pid, pid} <- [Port.info(port, :os_pid)],
            do: Integer.to_string(pid)

      assert length(shells) == 2
      cats = cats_of(shells)
      assert length(cats) == 2
      VllmBridge.Worker.OsProcess.kill(String.to_integer(hd(cats)))

      wait_until(
        # (A worker not up at this moment is nil in the list.)
        fn ->
          Enum.any?(workers!(@pool), &(&1 && &1.index == w.index and &1.os_pid != w.os_pid))
        end,
        60_000,
        "worker #{w.index} to start again"
      )

      refute Process.alive?(reader)
      fresh = Enum.find(workers!(@pool), &(&1 && &1.index == w.index))
      text = unique("read-again")
      {:ok, pid} = VllmBridge.Worker.call(fresh.pid, "rt_output", "say", [text], %{}, 60_000)
      assert {:info, _, %{os_pid: ^pid}} = await_log(text)
    end
  end

  describe "routine start and stop" do
    test "write nothing to stdout or stderr" do
      {:ok, _} = VllmBridge.start_pool(:rt_output_quiet, Keyword.merge(opts([]), size: 2))
      ws = workers!(:rt_output_quiet)

      {:ok, 3} =
        VllmBridge.call({"vllm_bridge.bridge.diag", "add"}, [1, 2], %{},
          pool_name: :rt_output_quiet
        )

      readers = Enum.flat_map(ws, &output_readers(&1.pid))
      assert length(readers) == 2
      :ok = VllmBridge.stop_pool(:rt_output_quiet)
      # The readers log what came last once their FIFOs end, then stop.
      wait_until(fn -> not Enum.any?(readers, &Process.alive?/1) end)
      Enum.each(flush_logs_full(), &Process.put(:stash, Process.get(:stash, []) ++ [&1]))

      lines =
        for {_level, message, %{vllm_pool: :rt_output_quiet} = meta} <- Process.get(:stash, []),
            Map.has_key?(meta, :python_stream),
            do: message

      assert lines == []
    end
  end

  # The `cat` processes whose parent is one of `shells` (OS pids, strings).
  defp cats_of(shells) do
    for dir <- File.ls!("/proc"),
        dir =~ ~r/^\d+$/,
        {:ok, stat} <- [File.read("/proc/#{dir}/stat")],
        [_, comm, rest] <- [Regex.run(~r/^\d+ \((.*)\) (.*)$/s, stat)],
        comm == "cat",
        Enum.at(String.split(rest), 1) in shells,
        do: dir
  end

  defp flush_logs_full(acc \\ []) do
    receive do
      {:log, level, message, meta} -> flush_logs_full([{level, message, meta} | acc])
    after
      0 -> Enum.reverse(acc)
    end
  end

  describe "a reader that cannot keep up" do
    test "drops chunks past its backlog and says how many bytes" do
      [w | _] = workers!(@pool)
      [reader] = output_readers(w.pid)
      port = :sys.get_state(reader).streams |> Map.keys() |> hd()
      tag = unique("backlog")
      # Held while 2 000 chunks arrive, as when Logger blocks it.
      :ok = :sys.suspend(reader)
      for i <- 1..2_000, do: send(reader, {port, {:data, "#{tag} #{i}\n"}})
      :ok = :sys.resume(reader)

      {:warning, message, meta} = await_log("bytes of output dropped")
      assert meta.os_pid == w.os_pid
      [_, dropped] = Regex.run(~r/(\d+) bytes of output dropped/, message)
      assert String.to_integer(dropped) > 0
      # The chunks it kept were logged: the last one, at least.
      await_log("#{tag} 2000")
      kept = Enum.count(Process.get(:stash, []), fn {_, m, _} -> String.contains?(m, tag) end)
      assert kept < 2_000
    end
  end

  describe "cutting lines" do
    defp feed(chunks) do
      stream = %{name: :stdout, buf: "", skip: false, os_pid: nil}
      Enum.reduce(chunks, stream, &VllmBridge.Worker.OutputLines.feed(&2, &1, vllm_pool: :t))
    end

    test "a very long line is cut at max_line, its rest dropped up to its newline" do
      max = Output.max_line()
      long = String.duplicate("a", max * 3)
      stream = feed([long, "b", "\nnext\n"])
      assert stream.buf == ""
      assert [cut, "[python stdout] next"] = pool_logs(:t)

      assert cut ==
               "[python stdout] " <> String.duplicate("a", max) <> " [line cut at #{max} bytes]"
    end

    test "lines split across chunks come whole; \\r\\n split across chunks is one end" do
      stream = feed(["he", "llo\r", "\nwor", "ld"])
      assert pool_logs(:t) == ["[python stdout] hello"]
      assert stream.buf == "world"
    end

    test "bytes that are not UTF-8 are replaced, not a crash" do
      feed([<<"ok ", 0xFF, 0xFE, " end\n">>])
      assert pool_logs(:t) == ["[python stdout] ok \uFFFD\uFFFD end"]
    end
  end
end
