defmodule VllmBridge.Runtime.StartDeadlineTest do
  @moduledoc """
  How long `start_pool` waits: each worker has `start_timeout` for its handshake and
  `start_timeout` more for its `on_start`, enforced by the worker itself, and
  `start_pool` waits for those limits, never giving up first. Real workers; the handshake
  is held back by an interpreter wrapper that waits for a file, the setup by a gate file
  (test/support/own_modules/vb_setup_mod.py), so the stages end when the test says.
  The times are small, but they cannot be smaller than the interpreter's own start
  (torch is imported before the handshake).
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import ExUnit.CaptureLog
  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Pool, Worker}

  @own_dir Path.expand("../support/own_modules", __DIR__)
  @own [python_path: [@own_dir], modules: ["vb_setup_mod"]]

  setup do
    dir = Path.join(System.tmp_dir!(), "vb-deadline-#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf!(dir) end)
    %{dir: dir}
  end

  # An interpreter that waits until `gate` exists, then is the test venv's.
  defp gated_python(dir, gate) do
    python = Path.join(dir, "gated-python")
    real = Application.fetch_env!(:vllm_bridge, :python)

    File.write!(python, """
    #!/bin/sh
    while [ ! -e '#{gate}' ]; do sleep 0.02; done
    exec '#{real}' "$@"
    """)

    File.chmod!(python, 0o755)
    python
  end

  defp now, do: System.monotonic_time(:millisecond)
  defp sleep_until(t), do: Process.sleep(max(t - now(), 0))

  test "a start whose handshake and on_start together take longer than start_timeout " <>
         "(each within it) succeeds",
       %{dir: dir} do
    # start_pool gave up at start_timeout + 5 s (21 s), while the worker may take twice
    # start_timeout: the handshake is let through after 7 s and the setup is held until
    # 21.5 s, each within its own 16 s: the interpreter has 9 s to import torch, however
    # loaded the machine, and the setup's own limit ends 1.5 s (plus that import) after
    # the gate opens, at 23 s at the earliest.
    timeout = 16_000
    [py_gate, started, gate] = Enum.map(~w(py-gate started gate), &Path.join(dir, &1))

    opts =
      @own ++
        [
          size: 1,
          python: gated_python(dir, py_gate),
          start_timeout: timeout,
          on_start: {"vb_setup_mod", "gated_setup", [started, gate, "slow"]}
        ]

    t0 = now()
    starter = Task.async(fn -> VllmBridge.start_pool(:sd_slow, opts) end)
    on_exit(fn -> VllmBridge.stop_pool(:sd_slow) end)

    sleep_until(t0 + 7_000)
    File.write!(py_gate, "")
    wait_until(fn -> File.exists?(started) end, timeout, "the handshake and the setup to begin")

    sleep_until(t0 + timeout + 5_500)
    # Still waiting (the setup is within its own limit), not given up.
    assert Task.yield(starter, 0) == nil
    assert {:ok, [nil]} = Pool.workers(:sd_slow)

    File.write!(gate, "")
    assert {:ok, _sup} = Task.await(starter, 2 * timeout)

    assert {:ok, %{"tag" => "slow", "setups" => 1}} =
             VllmBridge.call({"vb_setup_mod", "use"}, [], %{}, pool_name: :sd_slow)
  end

  test "an on_start past its own limit fails naming the worker, on_start and start_timeout",
       %{dir: dir} do
    [started, gate] = Enum.map(~w(started gate), &Path.join(dir, &1))

    log =
      capture_log(fn ->
        result =
          VllmBridge.start_pool(
            :sd_overstay,
            @own ++
              [
                size: 1,
                # Room for the handshake's torch import on a loaded machine.
                start_timeout: 12_000,
                on_start: {"vb_setup_mod", "gated_setup", [started, gate, "never"]}
              ]
          )

        send(self(), {:result, result})
      end)

    assert_received {:result, {:error, %Error{type: :timeout, message: m}}}
    # The setup began (the handshake was in time), and the worker's own timer ended it.
    assert File.exists?(started)
    assert m =~ "pool :sd_overstay did not start: worker 0 (os pid"
    assert m =~ "on_start vb_setup_mod.gated_setup failed"
    assert m =~ "did not return within 12000 ms (start_timeout)"
    refute m =~ "not answering"
    assert length(String.split(log, "did not return within 12000 ms")) - 1 == 1
    refute :sd_overstay in Pool.names()
  end

  test "await_ready with a timeout of its own names the stage the worker is in", %{dir: dir} do
    [started, gate] = Enum.map(~w(started gate), &Path.join(dir, &1))

    {:ok, w} =
      Worker.start_link(
        env: [{"PYTHONPATH", @own_dir}],
        modules: ["vb_setup_mod"],
        on_start: {"vb_setup_mod", "gated_setup", [started, gate, "w"], %{}}
      )

    wait_until(fn -> File.exists?(started) end, 60_000, "the setup to begin")

    assert {:error, %Error{type: :timeout, message: m, details: %{stage: "on_start"}}} =
             Worker.await_ready(w, 50)

    assert m =~ "within 50 ms (it was in its on_start stage)"

    # It goes on: the gate opens, the start finishes.
    File.write!(gate, "")
    assert {:ok, %{"pid" => _}} = Worker.await_ready(w)
    assert {:ok, %{"tag" => "w", "setups" => 1}} = Worker.call(w, "vb_setup_mod", "use", [])
  end
end
