# Where one small call's round trip goes (issue 19; bench/results/erlport-round-trip.md,
# "Where a round trip goes"). One caller, one call at a time, subjects alternating in
# rounds so that a busy moment of the shared machine lands on all of them:
#
#   full      the trivial call through the whole stack (binding -> pool -> worker process
#             -> port -> Python worker -> back), a pool of 2 workers, as part 1;
#   direct    the same request frame written by the caller itself to a port it owns, on
#             a Python worker started as the pool starts it (no pool, no worker process,
#             no Elixir codec): the Python worker and the pipes alone;
#   direct-1t the same, the worker started without its watcher and lifeline threads (a
#             throwaway monkeypatch at start-up, not a mode of the worker: it measures what
#             the extra threads cost a round trip);
#   wproc     a request built once, sent with VllmBridge.Call.Request.call/3 straight to
#             a pool worker's process: the worker process's own work without the
#             caller's (options, binding, encoding, routing, checkout);
#   hop-both  the same worker behind a process that owns its port: the caller sends the
#             frame to it, it writes it, and forwards the reply (the bridge's two process
#             hops, none of its bookkeeping);
#   hop-reply the same, but the caller writes the frame to the port itself (any process
#             may port_command a port): one hop, the reply's;
#   erlport   :python.call of the same Python function (when ERLPORT_DIR holds a build);
#   echo      bench/raw_echo.py, the floor.
#
#   mix run bench/roundtrip_breakdown.exs [calls_per_round] [rounds] [pin]
#
# `pin` (any third argument): the BEAM, every Python process and the echo on CPU 0.
# Reading it: full - direct = the BEAM's share (codec, options, routing, the worker
# process hop, reply decode); direct - echo = the Python worker's share (its CPU and its
# wake-ups); direct - direct-1t = the extra threads' share.

alias VllmBridge.Bench.{Erlport, Pinning, ProcCpu, RawEcho, Stats, Trivial}

[calls, rounds, pin] =
  case System.argv() do
    [] -> [2_000, 10, nil]
    [c] -> [String.to_integer(c), 10, nil]
    [c, r] -> [String.to_integer(c), String.to_integer(r), nil]
    [c, r, _] -> [String.to_integer(c), String.to_integer(r), 0]
  end

python = Application.fetch_env!(:vllm_bridge, :python)
pypath = Path.expand("python")

defmodule Direct do
  # A port to a Python worker that the caller owns: the launcher's port options, the
  # worker's own framing (4-byte length, then the body).
  def open(python, argv) do
    port =
      Port.open({:spawn_executable, python}, [
        {:args, argv},
        {:env, [{~c"PYTHONPATH", String.to_charlist(Path.expand("python"))}]},
        :stream,
        :binary,
        :nouse_stdio,
        :exit_status
      ])

    {:ok, ["hello" | _]} = VllmBridge.Codec.decode(read(port, <<>>))
    port
  end

  def roundtrip(port, frame) do
    Port.command(port, frame)
    body = read(port, <<>>)
    # ["ok", id, true]: msgpack fixarray 3, "ok", the id, true
    <<0x93, 0xA2, "ok", _::binary>> = body
    :ok
  end

  defp read(port, acc) do
    case acc do
      <<len::32, body::binary-size(len)>> ->
        body

      _ ->
        receive do
          {^port, {:data, data}} -> read(port, acc <> data)
          {^port, {:exit_status, s}} -> raise "direct worker exited with #{s}"
        end
    end
  end
end

defmodule Owner do
  # A process that owns a port to a Python worker and forwards each reply frame to the
  # process that asked (FIFO): the bridge's process structure without its bookkeeping.
  # `via: :owner` - the caller sends the frame to the owner, which writes it (two hops,
  # as the bridge and erlport do); `via: :caller` - the caller writes the frame to the
  # port itself (port_command from a process that is not the owner) and only the reply
  # goes through the owner (one hop).
  def start(python, argv) do
    parent = self()

    pid =
      spawn_link(fn ->
        port = Direct.open(python, argv)
        send(parent, {:owner_port, self(), port})
        loop(port, :queue.new(), <<>>)
      end)

    receive do
      {:owner_port, ^pid, port} -> {pid, port}
    end
  end

  def call({pid, _port}, frame, :owner) do
    send(pid, {:req, self(), frame})
    await()
  end

  def call({pid, port}, frame, :caller) do
    send(pid, {:expect, self()})
    Port.command(port, frame)
    await()
  end

  defp await do
    receive do
      {:reply, <<0x93, 0xA2, "ok", _::binary>>} -> :ok
    end
  end

  defp loop(port, q, acc) do
    receive do
      {:req, from, frame} ->
        Port.command(port, frame)
        loop(port, :queue.in(from, q), acc)

      {:expect, from} ->
        loop(port, :queue.in(from, q), acc)

      {^port, {:data, data}} ->
        case acc <> data do
          <<len::32, body::binary-size(len), rest::binary>> ->
            {{:value, from}, q} = :queue.out(q)
            send(from, {:reply, body})
            loop(port, q, rest)

          more ->
            loop(port, q, more)
        end
    end
  end
end

worker_argv = ["-m", "vllm_bridge.bridge.worker"]

one_thread_argv = [
  "-c",
  "import sys; import vllm_bridge.bridge.worker.server as s; " <>
    "s.watch_parent = lambda: None; s.Worker._watch = lambda self: None; sys.exit(s.main())"
]

{:ok, _} = VllmBridge.start_pool(:breakdown, size: 2, max_in_flight: 32)
body = Trivial.request_frame()
frame = [<<byte_size(body)::32>>, body]
direct = Direct.open(python, worker_argv)
single = Direct.open(python, one_thread_argv)
echo = RawEcho.open(python)
owned = Owner.start(python, worker_argv)
owned2 = Owner.start(python, worker_argv)

erl =
  case Erlport.find() do
    {:ok, _} ->
      {:ok, p} =
        apply(:python, :start, [
          [{:python, String.to_charlist(python)}, {:python_path, [String.to_charlist(pypath)]}]
        ])

      p

    {:skip, why} ->
      IO.puts("erlport skipped: #{why}")
      nil
  end

os_pid = fn port -> elem(Port.info(port, :os_pid), 1) end
{:ok, pool_workers} = VllmBridge.Pool.workers(:breakdown)

erl_os = if erl, do: Erlport.os_pids(erl), else: []

# Whose CPU each subject spends outside the BEAM.
peer_pids = %{
  full: Enum.map(pool_workers, & &1.os_pid),
  direct: [os_pid.(direct)],
  "direct-1t": [os_pid.(single)],
  wproc: Enum.map(pool_workers, & &1.os_pid),
  "hop-both": [os_pid.(elem(owned, 1))],
  "hop-reply": [os_pid.(elem(owned2, 1))],
  echo: [os_pid.(echo)],
  erlport: erl_os
}

wpid = hd(pool_workers).pid

{:ok, wparts} =
  VllmBridge.Call.Wire.encode_invoke(
    {"vllm_bridge.forward_context", "is_forward_context_available"},
    [],
    %{}
  )

wreq =
  VllmBridge.Call.Request.new("call",
    pre: [VllmBridge.Call.Wire.value(nil)],
    post: wparts,
    target: {"vllm_bridge.forward_context", "is_forward_context_available"}
  )

subjects =
  [
    full: fn -> Trivial.call(pool_name: :breakdown) end,
    direct: fn -> Direct.roundtrip(direct, frame) end,
    "direct-1t": fn -> Direct.roundtrip(single, frame) end,
    wproc: fn -> VllmBridge.Call.Request.call(wpid, wreq, :infinity) end,
    "hop-both": fn -> Owner.call(owned, frame, :owner) end,
    "hop-reply": fn -> Owner.call(owned2, frame, :caller) end,
    echo: fn -> RawEcho.roundtrip(echo, body) end
  ] ++
    if erl,
      do: [
        erlport: fn ->
          apply(:python, :call, [
            erl,
            :"vllm_bridge.forward_context",
            :is_forward_context_available,
            []
          ])

          :ok
        end
      ],
      else: []

saved =
  if pin do
    pids = [System.pid() | Enum.concat(Map.values(peer_pids))]
    {:ok, saved} = Pinning.pin(pids, pin)
    saved
  else
    []
  end

Enum.each(subjects, fn {_, f} -> Stats.time_calls(500, f) end)

beam = System.pid()

{samples, cpu} =
  Enum.reduce(1..rounds, {%{}, %{}}, fn _, acc ->
    Enum.reduce(subjects, acc, fn {k, f}, {acc, cpu} ->
      # (In us.)
      b0 = ProcCpu.ns([beam]) / 1000
      p0 = ProcCpu.ns(peer_pids[k]) / 1000
      t = Stats.time_calls(calls, f)
      db = ProcCpu.ns([beam]) / 1000 - b0
      dp = ProcCpu.ns(peer_pids[k]) / 1000 - p0

      {Map.update(acc, k, t, &(t ++ &1)),
       Map.update(cpu, k, {db, dp}, fn {b, p} -> {b + db, p + dp} end)}
    end)
  end)

Pinning.restore(saved)

IO.puts(
  "round trip, one caller, #{calls * rounds} calls each (#{rounds} alternating rounds)" <>
    if(pin, do: ", everything pinned to CPU #{pin}", else: ", placement as the OS picks it")
)

for {k, _} <- subjects do
  s = samples[k]
  {b, p} = cpu[k]
  n = calls * rounds

  IO.puts(
    "  #{String.pad_trailing(to_string(k), 10)} p50 #{Stats.fmt(Stats.percentile(s, 50))} us" <>
      "  p90 #{Stats.fmt(Stats.percentile(s, 90))} us  p99 #{Stats.fmt(Stats.percentile(s, 99))} us" <>
      "  CPU per call: BEAM #{Stats.fmt(b / n)} us, Python #{Stats.fmt(p / n)} us"
  )
end

VllmBridge.stop_pool(:breakdown)
