defmodule VllmBridge.Runtime.SessionChaosTest do
  @moduledoc """
  Generated orders of sessions, affinities, references and failures against real
  workers: callers of several kinds (in a session or not, each affinity, a reference
  made and used, short timeouts) run at once while, at generated moments, a worker's
  Python process is killed (`kill -9`), callers are killed, sessions are closed and
  session owners die. Every caller that lives gets an answer of its own (an echo returns
  its own token, never another call's), of a type the situation allows, and none waits
  past its timeout by more than a bound; once every caller is gone and every session
  closed, no pool slot is left taken or waiter queued, and no worker holds a reference
  or a session but its default one.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Error, Pool, Ref, Session, Worker}
  alias VllmBridge.Pool.Slots

  @pool :rt_session_chaos
  # How long past its own timeout a caller may take to answer before it counts as
  # wedged (generous: the machine is shared and slow).
  @wedge_ms 30_000

  setup_all do
    start_pool!(@pool, size: 2, max_in_flight: 2, queue_size: 256, cancel_grace: 2_000)
    :ok
  end

  defp diag(fun, args, opts),
    do: VllmBridge.call({"vllm_bridge.bridge.diag", fun}, args, %{}, opts)

  # One caller's work, given the sessions' ids (some will be closed under it); returns
  # what it saw, checked by check/2.
  defp work({:echo, session, affinity, timeout, token}) do
    {:echo, token, diag("echo", [token], opts(session, affinity, timeout))}
  end

  defp work({:sleep, session, affinity, timeout, secs}) do
    {:sleep, secs, diag("sleep", [secs], opts(session, affinity, timeout))}
  end

  defp work({:ref, session, affinity, timeout, n}) do
    case diag("opaque", [n], opts(session, nil, timeout)) do
      {:ok, %Ref{} = ref} ->
        {:ref, n, VllmBridge.call({ref, "bump"}, [], %{}, opts(nil, affinity, timeout))}

      other ->
        {:ref, n, other}
    end
  end

  defp opts(session, affinity, timeout) do
    [pool_name: @pool, timeout: timeout] ++
      if(session, do: [session_id: session], else: []) ++
      if affinity, do: [affinity: affinity], else: []
  end

  @allowed [:worker_exit, :session_lost, :timeout, :pool_busy, :queue_full, :bad_argument]

  # A result is its own call's (an echo's token, a sleep's seconds) or an error of an
  # allowed type; :bad_argument only for a session closed under the call (its message
  # says so).
  defp check({:echo, token, {:ok, got}}), do: assert(got == token)
  defp check({:sleep, secs, {:ok, got}}), do: assert(got == secs)
  defp check({:ref, n, {:ok, got}}), do: assert(got == n + 1)

  defp check({_kind, _x, {:error, %Error{type: :bad_argument, message: msg}}}),
    do: assert(msg =~ "closed" or msg =~ "unknown session", msg)

  defp check({_kind, _x, {:error, %Error{type: type}}}), do: assert(type in @allowed)

  defp gen_op(sessions, n) do
    session = Enum.random([nil | sessions])
    affinity = Enum.random([nil, :strict_queue, :strict_fail_fast, :hint])
    timeout = Enum.random([40, 200, 1_000, 5_000])

    case rem(n, 3) do
      0 -> {:echo, session, affinity, timeout, "t-#{n}-#{System.unique_integer()}"}
      1 -> {:sleep, session, affinity, timeout, Enum.random([0.0, 0.01, 0.05, 0.2])}
      2 -> {:ref, session, affinity, timeout, n}
    end
  end

  defp kill9(index) do
    {:ok, ws} = Pool.workers(@pool)

    case Enum.at(ws, index) do
      %{os_pid: os_pid} -> System.cmd("kill", ["-9", Integer.to_string(os_pid)])
      nil -> :ok
    end
  end

  test "generated callers, kills, closes and owner deaths lose nothing and leak nothing" do
    for round <- 1..6 do
      # (Reproducible with the run's --seed.)
      :rand.seed(:exsss, {round, ExUnit.configuration()[:seed], 11})
      workers!(@pool)

      owners = for _ <- 1..4, do: spawn(fn -> receive(do: (:stop -> :ok)) end)

      sessions =
        for o <- owners do
          {:ok, s} = Session.open(pool_name: @pool, owner: o)
          s.id
        end

      parent = self()

      callers =
        for n <- 1..48 do
          op = gen_op(sessions, n + round * 1000)
          timeout = elem(op, 3)

          {pid, mon} = spawn_monitor(fn -> send(parent, {:done, self(), work(op)}) end)

          {pid, mon, timeout}
        end

      # Failures at generated moments while the callers run.
      events =
        Enum.shuffle(
          [{:kill9, rem(round, 2)}] ++
            for({pid, _, _} <- Enum.take_random(callers, 6), do: {:kill_caller, pid}) ++
            for(o <- Enum.take_random(owners, 2), do: {:owner_dies, o}) ++
            for(id <- Enum.take_random(sessions, 1), do: {:close, id})
        )

      for e <- events do
        Process.sleep(Enum.random(0..30))

        case e do
          {:kill9, i} -> kill9(i)
          {:kill_caller, pid} -> Process.exit(pid, :kill)
          {:owner_dies, o} -> send(o, :stop)
          {:close, id} -> Session.close(id, 10_000)
        end
      end

      for {pid, mon, timeout} <- callers do
        receive do
          {:done, ^pid, seen} ->
            check(seen)
            assert_receive {:DOWN, ^mon, :process, ^pid, _}, @wedge_ms

          {:DOWN, ^mon, :process, ^pid, reason} ->
            # Killed by the test; a caller that crashed would have its reason here.
            assert reason == :killed
            refute_received {:done, ^pid, _}
        after
          # A ref caller makes two calls; a call may wait its timeout queued, then run.
          3 * timeout + @wedge_ms -> flunk("caller #{inspect(pid)} wedged past its timeout")
        end
      end

      # Everything closed and gone: nothing left taken, queued or held.
      for o <- owners, do: send(o, :stop)
      for id <- sessions, do: Session.close(id, 10_000)
      {:ok, meta} = Pool.meta(@pool)
      ws = workers!(@pool)

      wait_until(
        fn -> Enum.all?(ws, &(Slots.load(meta, &1.index) == 0)) and Slots.waiting(meta) == 0 end,
        30_000,
        "round #{round}: every slot given back"
      )

      # (The workers looked up again each time: one killed late may still be listed.)
      wait_until(
        fn ->
          {:ok, ws} = Pool.workers(@pool)

          Enum.all?(ws, fn w ->
            w != nil and
              match?({:ok, %{"refs" => 0, "sessions" => n}} when n <= 1, Worker.ping(w.pid))
          end)
        end,
        30_000,
        "round #{round}: no reference or session left on the workers"
      )
    end
  end
end
