defmodule VllmBridge.Runtime.RuntimeOptionsTest do
  @moduledoc """
  `VllmBridge.Call.Runtime.resolve/2`: each timeout profile, the precedence of the sources of
  a timeout, defaults from the application config, refusals naming the bad value and the
  deadline fixed at entry; then, through a real pool, options that bound real calls.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.Error
  alias VllmBridge.Call.Runtime

  @pool :rt_opts

  setup_all do
    start_pool!(@pool, size: 1)
    :ok
  end

  # Each test may set `config :vllm_bridge, :runtime`; it is put back afterwards.
  setup do
    old = Application.fetch_env(:vllm_bridge, :runtime)

    on_exit(fn ->
      case old do
        {:ok, value} -> Application.put_env(:vllm_bridge, :runtime, value)
        :error -> Application.delete_env(:vllm_bridge, :runtime)
      end
    end)

    Application.delete_env(:vllm_bridge, :runtime)
    :ok
  end

  defp config(kw), do: Application.put_env(:vllm_bridge, :runtime, kw)

  defp resolve!(opts, kind \\ :call) do
    {:ok, rt} = Runtime.resolve(opts, kind)
    rt
  end

  defp refused(opts) do
    assert {:error, %Error{type: :bad_argument, message: msg}} = Runtime.resolve(opts)
    msg
  end

  describe "defaults and profiles" do
    test "no options: the :default profile and the documented defaults" do
      rt = resolve!([])

      assert %Runtime{
               timeout: 120_000,
               stream_timeout: 1_800_000,
               profile: :default,
               session_id: nil,
               pool_name: :default,
               pool_given?: false,
               affinity: :strict_queue
             } = rt

      assert resolve!(nil) == %{rt | deadline: resolve!(nil).deadline}
    end

    test "each profile's timeout and stream_timeout" do
      expected = %{
        default: {120_000, 1_800_000},
        ml_inference: {600_000, 1_800_000},
        batch_job: {:infinity, :infinity},
        streaming: {120_000, 1_800_000}
      }

      assert VllmBridge.Runtime.profiles() == expected

      for {name, {timeout, stream_timeout}} <- expected do
        rt = resolve!(timeout_profile: name)
        assert {rt.profile, rt.timeout, rt.stream_timeout} == {name, timeout, stream_timeout}
      end
    end

    test "the other options pass through" do
      rt = resolve!(pool_name: :p, affinity: :hint, session_id: "s-1")

      assert {rt.pool_name, rt.pool_given?, rt.affinity, rt.session_id} ==
               {:p, true, :hint, "s-1"}

      session = %VllmBridge.Session{id: "s-2", pool: :p, worker: 0, instance: "i", owner: self()}
      assert resolve!(session_id: session).session_id == "s-2"
      assert resolve!(timeout: :infinity).timeout == :infinity
      assert resolve!(stream_timeout: 0).stream_timeout == 0
    end
  end

  describe "precedence" do
    test "the call's own timeout wins over everything" do
      config(timeout: 1_000, timeout_profile: :ml_inference)
      assert resolve!(timeout: 7, timeout_profile: :batch_job).timeout == 7
      assert resolve!(stream_timeout: 9, timeout_profile: :batch_job).stream_timeout == 9
    end

    test "a profile named by the call wins over the configured timeout and profile" do
      config(timeout: 1_000, stream_timeout: 2_000, timeout_profile: :default)
      rt = resolve!(timeout_profile: :ml_inference)
      assert {rt.timeout, rt.stream_timeout} == {600_000, 1_800_000}
      rt = resolve!(timeout_profile: :batch_job)
      assert {rt.timeout, rt.stream_timeout} == {:infinity, :infinity}
    end

    test "the configured timeout wins over the configured profile" do
      config(timeout: 1_000, timeout_profile: :batch_job)
      rt = resolve!([])
      assert rt.timeout == 1_000
      # stream_timeout is not configured: the configured profile's.
      assert rt.stream_timeout == :infinity
      assert rt.profile == :batch_job
    end

    test "the configured profile wins over :default" do
      config(timeout_profile: :ml_inference)
      rt = resolve!([])
      assert {rt.profile, rt.timeout, rt.stream_timeout} == {:ml_inference, 600_000, 1_800_000}
    end

    test "other options: the call's, then the configured, then the default" do
      config(affinity: :strict_fail_fast, pool_name: :configured)
      rt = resolve!([])

      assert {rt.affinity, rt.pool_name, rt.pool_given?} ==
               {:strict_fail_fast, :configured, false}

      rt = resolve!(affinity: :hint, pool_name: :mine)
      assert {rt.affinity, rt.pool_name, rt.pool_given?} == {:hint, :mine, true}
    end
  end

  describe "without a :runtime config (the one-pass path)" do
    test "gives what the configured path gives for the same options" do
      session = %VllmBridge.Session{id: "s-1", pool: :p, worker: 0, instance: "i", owner: self()}

      cases = [
        [],
        [pool_name: :x],
        [session_id: "s-1", affinity: :hint],
        [session_id: session],
        [session_id: nil, timeout: 5, stream_timeout: :infinity],
        [timeout: :infinity, affinity: :strict_fail_fast, pool_name: {:any, "term"}],
        # Repeated keys: the first wins, as Keyword.fetch/2 reads them.
        [timeout: 5, timeout: 10],
        [pool_name: :a, pool_name: :b],
        # A profile goes the configured way; the answer is the same.
        [timeout_profile: :ml_inference, timeout: 3]
      ]

      for opts <- cases do
        quick = resolve!(opts)
        # An empty-but-present config forces the general path.
        config(affinity: :strict_queue)
        general = resolve!(opts)
        Application.delete_env(:vllm_bridge, :runtime)
        assert %{quick | deadline: 0} == %{general | deadline: 0}, inspect(opts)
      end

      assert resolve!(timeout: 5, timeout: 10).timeout == 5
      assert resolve!(session_id: session).session_id == "s-1"
    end

    test "bad values are still refused by name" do
      assert refused(timeout: -1) =~
               "timeout must be a non-negative integer (ms) of at most 4294967295 " <>
                 "(about 49 days) or :infinity, got -1"

      # Longer than `receive ... after` takes: refused by name, not raised in the receive.
      for key <- [:timeout, :stream_timeout], ms <- [4_294_967_296, 5_000_000_000] do
        assert refused([{key, ms}]) =~ "#{key} must be a non-negative integer (ms) of at most"
        assert refused([{key, ms}]) =~ "got #{ms}"
      end

      assert resolve!(timeout: 4_294_967_295).timeout == 4_294_967_295

      assert refused(affinity: :nearest) =~ ":nearest"

      assert refused(session_id: 42) =~
               "session_id must be a string or a VllmBridge.Session, got 42"

      assert refused(poolname: :x) =~ "unknown runtime option :poolname"
    end
  end

  describe "refusals name the bad value" do
    test "unknown options" do
      msg = refused(timeuot: 5)
      assert msg =~ ":timeuot" and msg =~ ":timeout"
    end

    test "bad values" do
      assert refused(timeout: -1) =~ "timeout" and refused(timeout: -1) =~ "-1"
      assert refused(timeout: "5") =~ ~s("5")
      assert refused(timeout: 1.5) =~ "1.5"

      assert refused(stream_timeout: :forever) =~ "stream_timeout" and
               refused(stream_timeout: :forever) =~ ":forever"

      assert refused(timeout_profile: :fast) =~ ":fast"
      assert refused(timeout_profile: :fast) =~ ":ml_inference"
      assert refused(affinity: :sticky) =~ ":sticky"
      assert refused(session_id: 12) =~ "session_id" and refused(session_id: 12) =~ "12"
      assert refused(node: "b@h") =~ "node must be" and refused(node: "b@h") =~ ~s("b@h")

      assert refused(node: :no_at_sign) =~ "name@host" and
               refused(node: :no_at_sign) =~ ":no_at_sign"
    end

    test "options that are not a keyword list" do
      assert refused(%{timeout: 5}) =~ "%{timeout: 5}"
      assert refused([{"timeout", 5}]) =~ ~s({"timeout", 5})
      assert refused([5]) =~ "keyword list"
    end

    test "a bad application config is refused naming the config" do
      config(timout: 5)
      msg = refused([])
      assert msg =~ "config :vllm_bridge, :runtime" and msg =~ ":timout"

      config(:not_a_list)
      msg = refused([])
      assert msg =~ "config :vllm_bridge, :runtime must be a keyword list"
      assert msg =~ ":not_a_list"

      config(timeout: -5)
      assert refused([]) =~ "-5"
    end
  end

  describe "the deadline" do
    test "is fixed when resolve runs: timeout for a call, stream_timeout for a stream" do
      before = System.monotonic_time(:millisecond)
      call = resolve!(timeout: 10_000, stream_timeout: 50_000)
      stream = resolve!([timeout: 10_000, stream_timeout: 50_000], :stream)
      later = System.monotonic_time(:millisecond)

      assert call.deadline >= before + 10_000 and call.deadline <= later + 10_000
      assert stream.deadline >= before + 50_000 and stream.deadline <= later + 50_000
      assert resolve!(timeout_profile: :batch_job).deadline == :infinity
    end

    test "remaining/1 counts down to 0 and never below" do
      now = System.monotonic_time(:millisecond)
      assert Runtime.remaining(:infinity) == :infinity
      assert Runtime.remaining(now - 1_000) == 0
      left = Runtime.remaining(now + 60_000)
      assert left > 0 and left <= 60_000
      assert Runtime.deadline(now, :infinity) == :infinity
      assert Runtime.deadline(now, 5) == now + 5
    end
  end

  describe "through a real pool" do
    defp sleep(seconds, opts),
      do:
        VllmBridge.call(
          {"vllm_bridge.bridge.diag", "sleep"},
          [seconds],
          %{},
          [pool_name: @pool] ++ opts
        )

    test "a configured timeout bounds a call; a profile named by the call lifts it" do
      config(timeout: 100)
      assert {:error, %Error{type: :timeout}} = sleep(0.5, [])
      # The Python call is not interrupted; wait for its late reply to be dropped.
      [%{pid: w}] = workers!(@pool)
      wait_until(fn -> VllmBridge.Worker.in_flight(w) == 0 end)

      assert {:ok, 0.5} = sleep(0.5, timeout_profile: :default)
      assert {:ok, 0.5} = sleep(0.5, timeout_profile: :batch_job)
      assert {:ok, 0.5} = sleep(0.5, timeout: 60_000)
    end

    test "a configured profile applies to calls that name none" do
      config(timeout_profile: :batch_job)
      assert {:ok, 0.2} = sleep(0.2, [])
      config(timeout_profile: :batch_job, timeout: 100)
      assert {:error, %Error{type: :timeout}} = sleep(0.5, [])
    end

    test "stream_timeout bounds a whole stream" do
      config(stream_timeout: 300)

      {:ok, s} =
        VllmBridge.stream({"vllm_bridge.bridge.diag", "count"}, [1_000, 0.02], %{},
          pool_name: @pool
        )

      assert %Error{type: :timeout} = catch_error(Enum.to_list(s))

      {:ok, s} =
        VllmBridge.stream({"vllm_bridge.bridge.diag", "count"}, [3], %{},
          pool_name: @pool,
          timeout_profile: :streaming
        )

      assert Enum.to_list(s) == [0, 1, 2]
    end

    test "bad options are refused before anything is sent; the pool keeps serving" do
      assert {:error, %Error{type: :bad_argument}} = sleep(0, timeout: :soon)

      assert {:error, %Error{type: :bad_argument}} =
               VllmBridge.stream({"vllm_bridge.bridge.diag", "count"}, [3], %{},
                 timeout_profile: :x
               )

      assert {:ok, 0.01} = sleep(0.01, [])
    end
  end
end
