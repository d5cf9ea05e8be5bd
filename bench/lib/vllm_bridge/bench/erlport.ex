defmodule VllmBridge.Bench.Erlport do
  @moduledoc """
  Part 9: the peer a user would pick instead of the bridge, erlport (v0.11.0), beside the
  full stack and the raw echo in the same run (issue 19).

  erlport is not a dependency of the project: it is built outside the repository with
  `bench/erlport/build.sh` and found through the `ERLPORT_DIR` environment variable (a
  directory holding `ebin/` and `priv/python3/`). Its modules are loaded at run time and
  called with `apply/3`, so nothing here needs it to compile. Without it, `find/0` says
  why and the part is skipped.

  What is measured, each in rounds that alternate the subjects:

  * round trip, one caller: `:python.call(p, :"vllm_bridge.forward_context",
    :is_forward_context_available, [])`, the same Python function the full stack's
    trivial call runs (`VllmBridge.Bench.Trivial`), so both do the same Python work; as
    the OS places the processes, then (with `taskset`) with every subject on one CPU, and
    with the BEAM on one CPU and every Python process on another;
  * throughput: 64 callers spread round-robin over 2 erlport Python processes, beside the
    full stack's pool of 2 workers (`max_in_flight: 32`, as part 2) and 2 raw echo ports;
  * binary round trips of 1, 16 and 64 MiB: `:python.call(p, :"vllm_bridge.bridge.diag",
    :echo, [binary])` (erlport passes an Elixir binary as Python `bytes`), to be read
    beside part 4's tensor echo of the same size.
  """

  alias VllmBridge.Bench.{Pinning, RawEcho, Stats, Throughput, Trivial}

  @mod :"vllm_bridge.forward_context"
  @fun :is_forward_context_available

  @doc """
  Looks for a built erlport: `{:ok, dir}` with its `ebin/` on the code path, or
  `{:skip, reason}`.
  """
  @spec find() :: {:ok, String.t()} | {:skip, String.t()}
  def find do
    case System.get_env("ERLPORT_DIR") do
      nil ->
        {:skip, "ERLPORT_DIR is not set (build erlport with bench/erlport/build.sh)"}

      "" ->
        {:skip, "ERLPORT_DIR is empty (build erlport with bench/erlport/build.sh)"}

      dir ->
        dir = Path.expand(dir)
        ebin = Path.join(dir, "ebin")
        python_half = Path.join(dir, "priv/python3/erlport/erlang.py")

        cond do
          not File.regular?(Path.join(ebin, "python.beam")) ->
            {:skip, "ERLPORT_DIR=#{dir} holds no ebin/python.beam (run bench/erlport/build.sh)"}

          not File.regular?(python_half) ->
            {:skip, "ERLPORT_DIR=#{dir} holds no #{python_half} (run bench/erlport/build.sh)"}

          true ->
            Code.prepend_path(ebin)

            case Code.ensure_loaded(:python) do
              {:module, :python} -> {:ok, dir}
              {:error, why} -> {:skip, "could not load erlport's :python from #{ebin}: #{why}"}
            end
        end
    end
  end

  @doc """
  Runs the part against pool `pool` (2 workers, `max_in_flight: 32`). Options:
  `:calls`, `:rounds`, `:warmup` (round trip), `:duration_ms` (throughput, per round),
  `:sizes_mib`, `:reps` (`fn mib -> count end`). Returns a map of samples and rates.
  """
  @spec run(term(), String.t(), keyword()) :: map()
  def run(pool, python, opts) do
    peers = [start_peer(python), start_peer(python)]

    try do
      lat = latency(pool, python, hd(peers), opts)
      thr = throughput(pool, python, peers, opts)
      bin = binaries(hd(peers), opts)
      %{latency: lat, throughput: thr, binaries: bin}
    after
      Enum.each(peers, &apply(:python, :stop, [&1]))
    end
  end

  @doc "Starts an erlport Python instance on `python`, its module imported: its pid."
  @spec start_peer(String.t()) :: pid()
  def start_peer(python) do
    {:ok, p} =
      apply(:python, :start, [
        [
          {:python, String.to_charlist(python)},
          {:python_path, [String.to_charlist(Path.expand("python"))]}
        ]
      ])

    # The first call imports the module (torch with it): not a round trip to time.
    reply = call_peer(p)
    unless is_boolean(reply), do: raise("erlport's first call returned #{inspect(reply)}")
    p
  end

  @doc "The OS pids of erlport instance `p`'s Python process (its port's)."
  @spec os_pids(pid()) :: [non_neg_integer()]
  def os_pids(p) do
    {:links, links} = Process.info(p, :links)
    for l <- links, is_port(l), do: elem(Port.info(l, :os_pid), 1)
  end

  @doc "The trivial call through erlport instance `p` (a boolean back)."
  @spec call_peer(pid()) :: term()
  def call_peer(p), do: apply(:python, :call, [p, @mod, @fun, []])

  # One caller's round trips in three placements. As the OS places the processes (what a
  # user gets), and, where `taskset` is there, in two placements set for every subject
  # alike: all on one CPU, and the BEAM on one CPU with the Python processes on another.
  # On a VM, a wake-up across vCPUs costs tens of microseconds, so the OS's placement of
  # each Python process decides its p50 more than its code does, and the full stack's
  # workers and erlport's process are placed independently
  # (bench/results/erlport-placement.md): the set placements compare like with like.
  defp latency(pool, python, peer, opts) do
    port = RawEcho.open(python)
    frame = Trivial.request_frame()

    try do
      subjects = [
        full: fn -> Trivial.call(pool_name: pool) end,
        erlport: fn -> if is_boolean(call_peer(peer)), do: :ok, else: :bad_reply end,
        raw: fn -> RawEcho.roundtrip(port, frame) end
      ]

      os = rounds(subjects, opts)
      {:ok, workers} = VllmBridge.Pool.workers(pool)
      {:os_pid, echo} = Port.info(port, :os_pid)
      pythons = [echo | Enum.map(workers, & &1.os_pid)] ++ os_pids(peer)
      Map.put(os, :placed, placed(subjects, pythons, opts))
    after
      RawEcho.close(port)
    end
  end

  defp placed(subjects, pythons, opts) do
    cond do
      not Pinning.available?() ->
        {:skip, "taskset is not available"}

      :erlang.system_info(:logical_processors_available) in [:unknown, 1] ->
        [one_cpu: placed_rounds(subjects, pythons, 0, opts)]

      true ->
        [
          one_cpu: placed_rounds(subjects, pythons, 0, opts),
          apart: placed_rounds(subjects, pythons, 1, opts)
        ]
    end
  end

  # The BEAM (every thread) on CPU 0 and the Python processes on `cpu`, then put back.
  # A pin that fails raises, as part 1's does (VllmBridge.Bench.Latency): taskset is
  # there, so a failure is a fault of the run, not a figure to leave out.
  defp placed_rounds(subjects, pythons, cpu, opts) do
    beam = pin!([System.pid()], 0, [])
    py = pin!(pythons, cpu, beam)

    try do
      rounds(subjects, opts)
    after
      Pinning.restore(py)
      Pinning.restore(beam)
    end
  end

  defp pin!(pids, cpu, saved) do
    case Pinning.pin(pids, cpu) do
      {:ok, pinned} ->
        pinned

      {:error, reason} ->
        Pinning.restore(saved)
        raise "could not pin part 9's processes to CPU #{cpu}: #{reason}"
    end
  end

  # Warm-up, then rounds alternating the subjects: `%{subject => samples_us}`.
  defp rounds(subjects, opts) do
    calls = Keyword.get(opts, :calls, 10_000)
    rounds = Keyword.get(opts, :rounds, 10)
    warmup = Keyword.get(opts, :warmup, 1_000)
    per_round = max(1, div(calls, rounds))
    Enum.each(subjects, fn {_, f} -> Stats.time_calls(warmup, f) end)
    empty = Map.new(subjects, fn {k, _} -> {k, []} end)

    Enum.reduce(1..rounds, empty, fn _, acc ->
      Enum.reduce(subjects, acc, fn {k, f}, acc ->
        Map.update!(acc, k, &(Stats.time_calls(per_round, f) ++ &1))
      end)
    end)
  end

  defp throughput(pool, python, peers, opts) do
    callers = Keyword.get(opts, :callers, 64)
    duration = Keyword.get(opts, :duration_ms, 3_000)
    owners = [RawEcho.start_owner(python), RawEcho.start_owner(python)]
    frame = Trivial.request_frame()
    peer_tuple = List.to_tuple(peers)

    try do
      subjects = [
        full: fn _i -> Trivial.call(pool_name: pool) end,
        erlport: fn i ->
          if is_boolean(call_peer(elem(peer_tuple, rem(i, 2)))), do: :ok, else: :bad_reply
        end,
        raw: fn i -> RawEcho.call(Enum.at(owners, rem(i, 2)), frame) end
      ]

      rounds =
        for _ <- 1..2,
            do: Map.new(subjects, fn {k, f} -> {k, Throughput.rate(f, callers, duration)} end)

      best = Map.new(Keyword.keys(subjects), fn k -> {k, Enum.max(Enum.map(rounds, & &1[k]))} end)
      Map.merge(best, %{callers: callers, seconds: duration / 1000})
    after
      Enum.each(owners, &RawEcho.stop_owner/1)
    end
  end

  # erlport's Python half joins the chunks of a large frame with `bytes +=` (quadratic),
  # so a 64 MiB round trip takes seconds: few repetitions.
  defp binaries(peer, opts) do
    sizes = Keyword.get(opts, :sizes_mib, [1, 16, 64])
    reps = Keyword.get(opts, :reps, fn mib -> if mib >= 16, do: 2, else: 10 end)

    Enum.map(sizes, fn mib ->
      bytes = mib * 1024 * 1024
      payload = :binary.copy(<<0xFF>>, bytes)

      echo = fn ->
        case apply(:python, :call, [peer, :"vllm_bridge.bridge.diag", :echo, [payload]]) do
          b when byte_size(b) == bytes -> :ok
          other -> {:bad_reply, other}
        end
      end

      Stats.time_calls(1, echo)
      samples = Stats.time_calls(reps.(mib), echo)
      %{mib: mib, bytes: bytes, reps: reps.(mib), ms: Stats.median(samples) / 1000}
    end)
  end
end
