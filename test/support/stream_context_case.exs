defmodule VllmBridge.StreamContextCase do
  @moduledoc false
  # What the stream and context-manager tests share: a one-worker pool named by the test
  # module's `@pool` (set it before `use`), a serving idle worker and an empty exit log
  # before each test, and helpers to call vllm_bridge.bridge.diag through that pool.
  use ExUnit.CaseTemplate

  using do
    quote do
      @moduletag :capture_log

      import VllmBridge.RuntimeHelpers

      alias VllmBridge.{Error, Pool, Ref, Session, Worker}
      alias VllmBridge.Pool.Slots

      setup_all do
        start_pool!(@pool,
          size: 1,
          max_in_flight: 2,
          allow: ["vllm_bridge.bridge.diag", "rt_stream_support"],
          worker_env: [python_path([support_dir()])]
        )

        :ok
      end

      setup do
        [%{pid: w}] = workers!(@pool)
        {:ok, meta} = Pool.meta(@pool)
        wait_until(fn -> worker_idle?(w, meta) end)
        {:ok, _} = diag("exit_log", [true])
        %{w: w, meta: meta}
      end

      defp opts(extra \\ []), do: [pool_name: @pool] ++ extra

      defp diag(fun, args, extra \\ []),
        do: VllmBridge.call({"vllm_bridge.bridge.diag", fun}, args, %{}, opts(extra))

      defp stream!(fun, args, kwargs \\ %{}, extra \\ []) do
        {:ok, s} = VllmBridge.stream({"vllm_bridge.bridge.diag", fun}, args, kwargs, opts(extra))
        s
      end

      defp exit_log, do: elem(diag("exit_log", []), 1)

      defp session!(extra \\ []) do
        {:ok, s} = Session.open([pool_name: @pool] ++ extra)
        on_exit(fn -> Session.close(s) end)
        s
      end
    end
  end
end
