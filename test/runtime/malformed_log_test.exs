defmodule VllmBridge.Runtime.MalformedLogTest do
  @moduledoc """
  Frames a worker writes that are not what the protocol says, in the fields this side
  prints: `log` frames whose level, logger name or message is a map, a list, an integer,
  nil, a huge or non-UTF-8 binary, or that lack fields or have too many, and a hello
  whose `import_errors` names modules by anything but strings. Each is logged as
  malformed (briefly) or refused by name; none takes the worker process down, and the
  calls that follow are answered (a fake worker, test/support/runtime_fake_worker.py).
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import ExUnit.CaptureLog
  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Worker}

  defp fake(mode, env \\ []) do
    [
      worker_module: "runtime_fake_worker",
      env: [{"PYTHONPATH", support_dir()}, {"FAKE_WORKER_MODE", mode} | env]
    ]
  end

  test "malformed log frames are logged as such, and the worker answers the calls after them" do
    Process.flag(:trap_exit, true)
    {:ok, w} = Worker.start_link(fake("bad_logs"))
    assert {:ok, _hello} = Worker.await_ready(w)

    log =
      capture_log(fn ->
        # Each answer follows one frame of each wrong shape, in the same write.
        for _ <- 1..3, do: assert({:ok, "served"} = Worker.call(w, "m", "f", [], %{}, 30_000))
        Logger.flush()
      end)

    assert Process.alive?(w)
    refute_received {:EXIT, ^w, _}
    assert log =~ ~s(malformed log frame)
    assert log =~ ~s(["log", "error", a map of 1 entry, "msg"])
    assert log =~ ~s(["log", "error", "name", a binary of 3000000 bytes])
    assert log =~ ~s(["log", 7, 8, 9])
    assert log =~ ~s(["log", "error"])
    # The huge fields (3 MB each, sent three times) are not copied into the log whole.
    assert byte_size(log) < 200_000
    Worker.close(w)
  end

  test "a hello whose import_errors are not strings is refused naming them, not a crash" do
    Process.flag(:trap_exit, true)

    long = String.duplicate("y", 100_000)
    cut = String.duplicate("y", 1_000) <> "..."

    for {errors, named} <- [
          {"{'m': {'a': 1}}", "m (a map of 1 entry)"},
          {"{'m': ['x', 1]}", "m (a list of 2 items)"},
          {"{'m': 5}", "m (5)"},
          {"{'m': None}", "m (nil)"},
          {"{1: 'x'}", "1 (x)"},
          {"{('a', 'b'): 'x'}", "a list of 2 items (x)"},
          {"{'m': b'\\xff\\xfe'}", "m (a binary of 2 bytes)"},
          # Text, but long: cut in the message.
          {"{'m': '#{long}'}", "m (#{cut})"},
          {"{'m#{long}': 'x'}", "m#{String.duplicate("y", 999)}... (x)"}
        ] do
      {:ok, w} =
        Worker.start_link(
          fake("serve", [{"FAKE_WORKER_HELLO_EXTRA", "{'import_errors': #{errors}}"}])
        )

      result = Worker.await_ready(w)

      assert match?({:error, %Error{type: :bad_argument}}, result),
             "#{errors}: #{inspect(result)}"

      {:error, %Error{message: msg}} = result

      assert msg =~ "could not import allow-listed module(s)"
      assert msg =~ "module(s): #{named}; fix the module"
      assert byte_size(msg) < 10_000
      assert_receive {:EXIT, ^w, {:shutdown, {:start_failed, %Error{type: :bad_argument}}}}
    end
  end
end
