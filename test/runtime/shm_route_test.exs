defmodule VllmBridge.Runtime.ShmRouteTest do
  @moduledoc """
  A call's route is resolved once (VllmBridge.Call.Run.run_encoded/4): the gate of its
  argument slots resolves it when a tensor over the threshold is encoded, and the request
  runs on that route; otherwise the run resolves it. Generated calls, with and without
  large tensors, through `VllmBridge.call/4` and a binding, to a pool whose workers read
  the slot directory, one whose worker does not, and one where one of two workers does
  not: every result comes back whole, slots are used exactly when the route's workers
  all read the directory, and each call decides its route once (counted with a call
  trace of the caller). Not async: it sets trace patterns and uses the slot directory.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log
  @moduletag timeout: 300_000

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Shm, Tensor}
  alias VllmBridge.Call.{Route, Run, Runtime, Wire}
  alias VllmBridge.Codec.SlotExt
  alias VllmBridge.Pool.Directory

  @diag "vllm_bridge.bridge.diag"
  @binding %{
    name: "ShmRouteTest.echo",
    params: [{:value, :required, :any}],
    target: {@diag, "echo"}
  }

  setup_all do
    %{path: _} = Shm.dir()
    tmp = Path.join(System.tmp_dir!(), "rt_shm_route_#{System.unique_integer([:positive])}")
    File.mkdir_p!(tmp)

    # :reads: its worker opened the directory. :pipe: its worker's python wrapper drops
    # the variable. :mixed: the first of its two workers to start keeps it, the other
    # drops it (mkdir is atomic: one winner).
    start_pool!(:rt_route_reads, size: 1, allow: [@diag])

    start_pool!(:rt_route_pipe,
      size: 1,
      allow: [@diag],
      python: python_wrapper(tmp, "unset VLLM_BRIDGE_SHM_DIR")
    )

    start_pool!(:rt_route_mixed,
      size: 2,
      allow: [@diag],
      python: python_wrapper(tmp, "mkdir '#{tmp}/first' 2>/dev/null || unset VLLM_BRIDGE_SHM_DIR")
    )

    on_exit(fn ->
      for p <- [:rt_route_reads, :rt_route_pipe, :rt_route_mixed], do: VllmBridge.stop_pool(p)
      File.rm_rf!(tmp)
    end)

    %{tmp: tmp}
  end

  # A float32 tensor of `n` elements whose values depend on `seed`.
  defp tensor(n, seed) do
    data = for i <- 0..255, into: <<>>, do: <<i * 0.5 + seed::little-float-32>>
    whole = :binary.copy(data, div(n, 256) + 1)
    Tensor.new(binary_part(whole, 0, 4 * n), :float32, [n])
  end

  # Runs `fun` in a fresh process traced for the calls that decide a route: `{result,
  # route resolutions, Directory.pool/1 look-ups made by Run (its lean path), ext 8
  # encodes}`.
  # diag.echo(big) through Run.run_encoded/4, its arguments encoded by `encode` (which
  # changes the pool meanwhile), traced as traced/1 says.
  defp traced_echo(rt, big, encode) do
    traced(fn ->
      Run.run_encoded(rt, "call", encode,
        what: {@diag, "echo"},
        bound: nil,
        payload: {[big], %{}}
      )
    end)
  end

  defp traced(fun) do
    me = self()

    pid =
      spawn(fn ->
        receive do
          :go -> send(me, {:result, self(), fun.()})
        end
      end)

    1 = :erlang.trace(pid, true, [:call])
    mon = Process.monitor(pid)
    send(pid, :go)

    result =
      receive do
        {:result, ^pid, result} -> result
        {:DOWN, ^mon, _, _, reason} -> flunk("the caller exited: #{inspect(reason)}")
      after
        120_000 -> flunk("the call did not return within 120 s")
      end

    ref = :erlang.trace_delivered(pid)
    assert_receive {:trace_delivered, ^pid, ^ref}, 10_000
    counts = drain(pid, %{resolve: 0, lean_pool: 0, slots: 0})
    {result, counts.resolve, counts.lean_pool, counts.slots}
  end

  defp drain(pid, acc) do
    receive do
      {:trace, ^pid, :call, {Route, :resolve, _}} ->
        drain(pid, %{acc | resolve: acc.resolve + 1})

      {:trace, ^pid, :call, {Directory, :pool, _}, {Run, _, _}} ->
        drain(pid, %{acc | lean_pool: acc.lean_pool + 1})

      {:trace, ^pid, :call, {Directory, :pool, _}, _other_caller} ->
        drain(pid, acc)

      {:trace, ^pid, :call, {SlotExt, :encode, _}} ->
        drain(pid, %{acc | slots: acc.slots + 1})
    after
      0 -> acc
    end
  end

  setup do
    # Global patterns; only the traced process of each call has the trace flag.
    caller = [{:_, [], [{:message, {:caller}}]}]
    :erlang.trace_pattern({Route, :resolve, 4}, true, [:global])
    :erlang.trace_pattern({Directory, :pool, 1}, caller, [:global])
    :erlang.trace_pattern({SlotExt, :encode, 2}, true, [:global])

    on_exit(fn ->
      for mfa <- [{Route, :resolve, 4}, {Directory, :pool, 1}, {SlotExt, :encode, 2}],
          do: :erlang.trace_pattern(mfa, false, [:global])
    end)

    :ok
  end

  test "generated calls resolve their route once and use slots exactly where it reads them" do
    %{min_bytes: min} = Shm.dir()
    big_n = div(min, 4) + 1
    seed = ExUnit.configuration()[:seed]
    :rand.seed(:exsss, {seed, 19, 3})

    for pool <- [:rt_route_reads, :rt_route_pipe, :rt_route_mixed] do
      wait_until(fn -> Directory.pool(pool) != :error end, 60_000, "#{pool} is up")
      await_idle!(pool)
    end

    assert Shm.pool_reads?(elem(Directory.pool(:rt_route_reads), 1))
    refute Shm.pool_reads?(elem(Directory.pool(:rt_route_pipe), 1))
    refute Shm.pool_reads?(elem(Directory.pool(:rt_route_mixed), 1))

    seen =
      for i <- 1..40 do
        pool = Enum.random([:rt_route_reads, :rt_route_pipe, :rt_route_mixed])
        larges = Enum.random([0, 0, 1, 2])
        smalls = Enum.random([0, 1, 2])

        tensors =
          Enum.shuffle(
            for(k <- 1..larges//1, do: tensor(big_n + k, i * 10 + k)) ++
              for(k <- 1..smalls//1, do: tensor(16 + k, i * 10 + k))
          )

        arg = Enum.random([tensors, {i, tensors}, %{"t" => tensors, "n" => i}])
        via = Enum.random([:call, :binding])

        call =
          case via do
            :call ->
              fn -> VllmBridge.call({@diag, "echo"}, [arg], %{}, pool_name: pool) end

            :binding ->
              fn ->
                VllmBridge.Bindings.call(@binding, [arg, [__runtime__: [pool_name: pool]]])
              end
          end

        what = "call #{i}: #{via} to #{pool}, #{larges} large and #{smalls} small tensors"
        {result, resolves, lean_pools, slots} = traced(call)

        assert result == {:ok, arg}, "#{what}: #{inspect(result, limit: 8)}"
        # One route decision: Route.resolve/4 (the gate's, or the general path's), or
        # the lean path's pool look-up, never both and never twice.
        assert resolves + lean_pools == 1, "#{what}: #{resolves} + #{lean_pools} resolutions"
        # A large tensor asks the gate, which resolves the route itself.
        if larges > 0, do: assert(resolves == 1, what)
        expected_slots = if pool == :rt_route_reads, do: larges, else: 0
        assert slots == expected_slots, "#{what}: #{slots} tensors went into slots"
        {pool, larges > 0}
      end

    # (The generated mix covered every pool with and without a large tensor.)
    assert MapSet.size(MapSet.new(seen)) == 6, inspect(Enum.frequencies(seen))
  end

  # The gate's route is the one the request runs on: a pool that stops after the gate saw
  # it (its tensors written to slots for its worker) and is started again, under the same
  # name, with a worker that does not read the directory, between the encode and the
  # run. Resolved again, the request would go to the new pool's worker, which cannot read
  # the slot; on the gate's route it is refused as the stopped pool's (:worker_exit), and
  # the next call goes to the new pool through the pipe.
  test "a pool restarted between the gate and the run: the request keeps the gate's route",
       %{tmp: tmp} do
    pool = :"rt_route_flip_#{System.unique_integer([:positive])}"
    start_pool!(pool, size: 1, allow: [@diag])
    await_idle!(pool)
    %{min_bytes: min} = Shm.dir()
    big = tensor(div(min, 4) + 5, 7)
    {:ok, rt} = Runtime.resolve(pool_name: pool)

    encode = fn ->
      encoded = Wire.encode_invoke({@diag, "echo"}, [big], %{})
      :ok = VllmBridge.stop_pool(pool)

      # (In the caller's process: start_pool!/2's on_exit is the test process's only.)
      python = python_wrapper(tmp, "unset VLLM_BRIDGE_SHM_DIR")
      {:ok, _} = VllmBridge.start_pool(pool, size: 1, allow: [@diag], python: python)
      :ok = VllmBridge.Pool.await_ready(pool, 60_000)
      refute Shm.pool_reads?(elem(Directory.pool(pool), 1))
      encoded
    end

    {result, resolves, lean_pools, slots} = traced_echo(rt, big, encode)

    assert slots == 1, "the tensor went into a slot for the first pool's worker"
    assert {:error, %Error{type: :worker_exit}} = result
    assert {resolves, lean_pools} == {1, 0}

    try do
      assert {:ok, ^big} = VllmBridge.call({@diag, "echo"}, [big], %{}, pool_name: pool)
    after
      VllmBridge.stop_pool(pool)
    end
  end

  # The route stays, its worker changes: the pool's one worker, killed after the gate saw
  # it read the directory, restarts without it (its wrapper keeps the variable on the
  # first start only). The request, on its route, would reach the new worker with a
  # slot's name it cannot read: it is refused before anything is sent (:worker_exit),
  # and the next call goes through the pipe.
  test "a worker restarted without the directory between the gate and the send is not sent slots",
       %{tmp: tmp} do
    pool = :"rt_route_restart_#{System.unique_integer([:positive])}"
    flag = Path.join(tmp, "started-#{pool}")
    python = python_wrapper(tmp, "mkdir '#{flag}' 2>/dev/null || unset VLLM_BRIDGE_SHM_DIR")
    start_pool!(pool, size: 1, allow: [@diag], python: python)
    await_idle!(pool)
    [w] = workers!(pool)
    assert Shm.pool_reads?(elem(Directory.pool(pool), 1))
    %{min_bytes: min} = Shm.dir()
    big = tensor(div(min, 4) + 9, 3)
    {:ok, rt} = Runtime.resolve(pool_name: pool)

    encode = fn ->
      encoded = Wire.encode_invoke({@diag, "echo"}, [big], %{})
      VllmBridge.Worker.OsProcess.kill(w.os_pid)

      wait_until(
        fn -> match?([%{os_pid: p}] when p != w.os_pid, workers!(pool)) end,
        60_000,
        "the worker restarts"
      )

      await_idle!(pool)
      refute Shm.pool_reads?(elem(Directory.pool(pool), 1))
      encoded
    end

    {result, resolves, lean_pools, slots} = traced_echo(rt, big, encode)

    assert slots == 1
    assert {:error, %Error{type: :worker_exit, message: m}} = result
    assert m =~ "no longer reads the slot directory (it restarted without it", m
    assert {resolves, lean_pools} == {1, 0}
    assert {:ok, ^big} = VllmBridge.call({@diag, "echo"}, [big], %{}, pool_name: pool)
  end
end
