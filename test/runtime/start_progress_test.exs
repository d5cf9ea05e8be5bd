Code.require_file("../support/telemetry_helpers.exs", __DIR__)

defmodule VllmBridge.Runtime.StartProgressTest do
  @moduledoc """
  A pool's start, worker by worker: the `:progress` callback (a function or an MFA) gets
  each worker's stages in order, the telemetry event `[:vllm_bridge, :worker, :progress]`
  carries the same stages with `elapsed` in native units, one Logger info line says each
  worker is ready, a callback that raises does not stop the start, and a bad `:progress`
  is refused naming it. Real workers.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log
  # Defined at run time (the stand-in) or by the host: not known when this compiles.
  @compile {:no_warn_undefined, :telemetry}

  import ExUnit.CaptureLog
  import VllmBridge.RuntimeHelpers, only: [device?: 1]

  @diag "vllm_bridge.bridge.diag"

  # The stand-in :telemetry of test/support (the hex package cannot be fetched here).
  setup do
    VllmBridge.TelemetryHelpers.load!()
  end

  def record(info, pid), do: send(pid, {:progress, info})

  defp stages(pool, index, acc \\ []) do
    receive do
      {:progress, %{pool: ^pool, index: ^index, stage: stage} = info} ->
        if stage in [:ready, :failed],
          do: Enum.reverse([info | acc]),
          else: stages(pool, index, [info | acc])
    after
      60_000 -> flunk("worker #{index} of #{inspect(pool)} did not finish its start")
    end
  end

  # The stages but :waiting, which comes any number of times (every 2 s of a start).
  defp named_stages(infos), do: for(%{stage: s} <- infos, s != :waiting, do: s)

  test "a callback hears each worker's stages in order, and telemetry carries them" do
    test = self()
    id = {__MODULE__, System.unique_integer()}

    :ok =
      :telemetry.attach(
        id,
        [:vllm_bridge, :worker, :progress],
        fn event, m, md, _ -> send(test, {:event, event, m, md}) end,
        nil
      )

    on_exit(fn -> :telemetry.detach(id) end)

    log =
      capture_log([level: :info], fn ->
        {:ok, _} =
          VllmBridge.start_pool(:rt_progress,
            size: 2,
            allow: [@diag],
            on_start: {@diag, "add", [1, 2]},
            progress: &send(test, {:progress, &1})
          )
      end)

    on_exit(fn -> VllmBridge.stop_pool(:rt_progress) end)

    for i <- [0, 1] do
      infos = stages(:rt_progress, i)
      # :waiting may come, any number of times (a loaded box can take 4 s or more); the
      # order of the others is fixed.
      assert named_stages(infos) == [:launch, :handshake, :on_start, :ready]
      ready = List.last(infos)
      assert device?(ready.device) and is_integer(ready.os_pid)
      assert ready.elapsed_ms >= hd(infos).elapsed_ms
      assert log =~ "vllm_bridge pool :rt_progress: worker #{i} ready in "
      assert log =~ "(os pid #{ready.os_pid}, device #{ready.device})"
    end

    events = for {:event, e, m, md} <- flush(), md.pool == :rt_progress, do: {e, m, md}

    for i <- [0, 1] do
      mine = for {_, m, %{index: ^i} = md} <- events, md.stage != :waiting, do: {md.stage, m}
      assert Enum.map(mine, &elem(&1, 0)) == [:launch, :handshake, :on_start, :ready]
      elapsed = Enum.map(mine, fn {_, m} -> m.elapsed end)
      assert Enum.all?(elapsed, &is_integer/1) and elapsed == Enum.sort(elapsed)
    end

    assert Enum.all?(events, fn {e, _, _} -> e == [:vllm_bridge, :worker, :progress] end)
  end

  defp flush(acc \\ []) do
    receive do
      msg -> flush([msg | acc])
    after
      0 -> Enum.reverse(acc)
    end
  end

  test "an {m, f, a} callback, and a failed start's :failed stage" do
    {:error, _} =
      VllmBridge.start_pool(:rt_progress_mfa,
        size: 1,
        allow: [@diag],
        on_start: {@diag, "fail", ["no model today"]},
        progress: {__MODULE__, :record, [self()]}
      )

    infos = stages(:rt_progress_mfa, 0)
    assert named_stages(infos) == [:launch, :handshake, :on_start, :failed]
    assert %VllmBridge.Error{message: m} = List.last(infos).error
    assert m =~ "no model today"
  end

  test "a callback that raises is logged once and the start goes on" do
    log =
      capture_log(fn ->
        {:ok, _} =
          VllmBridge.start_pool(:rt_progress_raise,
            size: 1,
            allow: [@diag],
            progress: fn _info -> raise "progress display broke" end
          )
      end)

    on_exit(fn -> VllmBridge.stop_pool(:rt_progress_raise) end)
    assert {:ok, 3} = VllmBridge.call({@diag, "add"}, [1, 2], %{}, pool_name: :rt_progress_raise)
    assert length(String.split(log, "progress display broke")) == 2
    assert log =~ "the progress callback failed on worker 0's launch stage"
  end

  @tag timeout: 180_000
  test "a callback that blocks holds no worker, and start_pool returns by its deadline" do
    test = self()

    callback = fn
      %{stage: :launch, index: 0} ->
        send(test, {:blocked, self()})
        Process.sleep(:infinity)

      info ->
        send(test, {:progress, info})
    end

    log =
      capture_log(fn ->
        result =
          VllmBridge.start_pool(:rt_progress_block,
            size: 2,
            allow: [@diag],
            start_timeout: 20_000,
            progress: callback
          )

        send(test, {:result, result})
      end)

    on_exit(fn -> VllmBridge.stop_pool(:rt_progress_block) end)
    # The callback ran outside start_pool's caller and the workers: blocked in a
    # process of its own, which start_pool stopped at its deadline.
    assert_received {:blocked, runner}
    assert runner != test
    ref = Process.monitor(runner)
    assert_receive {:DOWN, ^ref, :process, ^runner, _}, 5_000
    # Every worker started (none waited for the callback) and the pool serves.
    assert_received {:result, {:ok, _}}
    assert {:ok, ws} = VllmBridge.Pool.workers(:rt_progress_block)
    assert Enum.all?(ws, &is_map/1) and length(ws) == 2
    assert {:ok, 3} = VllmBridge.call({@diag, "add"}, [1, 2], %{}, pool_name: :rt_progress_block)
    assert log =~ "the progress callback was still running at the start's deadline"
    # Nothing reached the callback after it blocked (it handles the stages in order).
    refute_received {:progress, _}
  end

  test "a bad :progress is refused, naming it" do
    for bad <- [fn -> :arity0 end, :not_a_function, {__MODULE__, :no_such_fun, []}] do
      assert {:error, %VllmBridge.Error{type: :bad_argument, message: m}} =
               VllmBridge.start_pool(:rt_progress_bad, progress: bad)

      assert m =~ "pool option progress"
      assert m =~ inspect(bad, limit: 8)
    end

    refute :rt_progress_bad in VllmBridge.Pool.names()
  end
end
