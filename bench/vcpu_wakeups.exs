# What a wake-up across vCPUs costs a one-caller round trip, and what a Python side that
# spins before it sleeps buys (issue 19; bench/results/erlport-placement.md). The BEAM
# (every thread) runs on CPU 0; every Python process on CPU 0 (`together`) or on CPU 1
# (`apart`). Subjects, in alternating rounds: an echo (bench/spin_echo.py) that sleeps in
# its read, one that spins up to 100 us for the next frame and works W us before each
# reply (W = 0, 5, 10, 20, 40), the whole stack's trivial call with the pool's default
# (`poll_us: 0`) and with `poll_us: 100`, and erlport's where ERLPORT_DIR holds a build.
#
#   mix run bench/vcpu_wakeups.exs together|apart [rounds calls]

alias VllmBridge.Bench.{Erlport, Pinning, Stats, Trivial}

{place, rounds, calls} =
  case System.argv() do
    [p] -> {p, 5, 2_000}
    [p, r, c] -> {p, String.to_integer(r), String.to_integer(c)}
    _ -> raise "usage: mix run bench/vcpu_wakeups.exs together|apart [rounds calls]"
  end

cpu =
  case place do
    "together" -> 0
    "apart" -> 1
    other -> raise "the placement must be together or apart, got #{inspect(other)}"
  end

unless Pinning.available?(), do: raise("taskset is needed to set the placement")
python = Application.fetch_env!(:vllm_bridge, :python)
frame = Trivial.request_frame()

echo = fn args ->
  Port.open({:spawn_executable, python}, [
    {:args, [Path.expand("bench/spin_echo.py") | args]},
    {:packet, 4},
    :binary,
    :nouse_stdio,
    :exit_status
  ])
end

roundtrip = fn port ->
  fn ->
    Port.command(port, frame)

    receive do
      {^port, {:data, _}} -> :ok
      {^port, {:exit_status, status}} -> raise "an echo exited with status #{status}"
    after
      10_000 -> raise "an echo did not answer in 10 s"
    end
  end
end

echoes =
  [{"echo, sleeps in its read", echo.(["0", "0"])}] ++
    for w <- [0, 5, 10, 20, 40], do: {"echo, spins 100 us, works #{w} us", echo.(["100", "#{w}"])}

{:ok, _} = VllmBridge.start_pool(:wake_default, size: 1)
{:ok, _} = VllmBridge.start_pool(:wake_poll, size: 1, poll_us: 100)
{:ok, [w0]} = VllmBridge.Pool.workers(:wake_default)
{:ok, [wp]} = VllmBridge.Pool.workers(:wake_poll)

erl =
  case Erlport.find() do
    {:ok, _} ->
      Erlport.start_peer(python)

    {:skip, why} ->
      IO.puts("erlport skipped: #{why}")
      nil
  end

erlport_reply = fn r -> Stats.check!(if is_boolean(r), do: :ok, else: {:bad_reply, r}) end

subjects =
  Enum.map(echoes, fn {k, port} -> {k, roundtrip.(port)} end) ++
    [
      {"whole stack", fn -> Stats.check!(Trivial.call(pool_name: :wake_default)) end},
      {"whole stack, poll_us: 100", fn -> Stats.check!(Trivial.call(pool_name: :wake_poll)) end}
    ] ++ if(erl, do: [{"erlport", fn -> erlport_reply.(Erlport.call_peer(erl)) end}], else: [])

pythons =
  Enum.map(echoes, fn {_, p} -> elem(Port.info(p, :os_pid), 1) end) ++
    [w0.os_pid, wp.os_pid] ++ if(erl, do: Erlport.os_pids(erl), else: [])

{:ok, beam} = Pinning.pin([System.pid()], 0)

py =
  case Pinning.pin(pythons, cpu) do
    {:ok, py} ->
      py

    {:error, why} ->
      Pinning.restore(beam)
      raise "could not pin the Python processes to CPU #{cpu}: #{why}"
  end

try do
  Enum.each(subjects, fn {_, f} -> Stats.time_calls(1_000, f) end)

  samples =
    Enum.reduce(1..rounds, %{}, fn _, acc ->
      Enum.reduce(subjects, acc, fn {k, f}, acc ->
        t = Stats.time_calls(calls, f)
        Map.update(acc, k, t, &(t ++ &1))
      end)
    end)

  IO.puts(
    "BEAM on CPU 0, Python processes on CPU #{cpu} (#{place}); #{rounds} rounds of #{calls}"
  )

  for {k, _} <- subjects do
    [p10, p50, p90] = for q <- [10, 50, 90], do: Stats.fmt(Stats.percentile(samples[k], q))
    IO.puts("  #{String.pad_trailing(k, 34)} p10 #{p10}  p50 #{p50}  p90 #{p90} us")
  end
after
  Pinning.restore(py)
  Pinning.restore(beam)
end
