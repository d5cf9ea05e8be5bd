# A throwaway prototype (issue 19, part 3): what a tensor round trip through shared
# memory would cost, measured before the bridge gets such a path. Three ways, alternating
# in rounds, the medians printed:
#
#   pipe   the bytes through the port and back ({packet, 4}, as bench/raw_echo.py): the
#          floor the issue's "2x the pipe echo" target is against;
#   fresh  a new file per transfer in a private directory on /dev/shm: the BEAM writes
#          it (File.write, :exclusive), Python maps it, copies it into a tensor and
#          unlinks it, writes a new file of its own, and the BEAM reads and deletes that;
#   slot   one file per direction, kept and reused (its pages stay allocated): the BEAM
#          pwrites into its slot, Python copies out of its mapping into a new tensor and
#          into its own slot's mapping, the BEAM preads from that slot.
#
#   mix run bench/shm_proto/run.exs [rounds]
#
# Each figure is the tensor's bytes over the median round trip, as part 4 counts them.

rounds = String.to_integer(List.first(System.argv()) || "5")
python = Application.fetch_env!(:vllm_bridge, :python)

dir =
  Path.join("/dev/shm", "vllm_bridge-proto-#{System.pid()}-#{System.unique_integer([:positive])}")

File.mkdir_p!(dir)
File.chmod!(dir, 0o700)

port =
  Port.open({:spawn_executable, python}, [
    {:args, [Path.expand("bench/shm_proto/peer.py"), dir]},
    {:packet, 4},
    :binary,
    :nouse_stdio,
    :exit_status
  ])

ask = fn frame ->
  Port.command(port, frame)

  receive do
    {^port, {:data, d}} -> d
    {^port, {:exit_status, s}} -> raise "peer exited with #{s}"
  end
end

{:ok, eslot} = :file.open(Path.join(dir, "e.slot"), [:read, :write, :raw, :binary])

ways = %{
  pipe: fn data ->
    n = byte_size(data)
    ^n = byte_size(ask.(data))
  end,
  fresh: fn data ->
    name = "e-" <> Base.encode16(:crypto.strong_rand_bytes(16), case: :lower)
    :ok = File.write(Path.join(dir, name), data, [:exclusive, :raw])
    reply = ask.("fresh:" <> name)
    true = Regex.match?(~r/^p-[0-9a-f]{32}$/, reply)
    path = Path.join(dir, reply)
    {:ok, back} = File.read(path)
    File.rm!(path)
    n = byte_size(data)
    ^n = byte_size(back)
  end,
  slot: fn data ->
    n = byte_size(data)
    :ok = :file.pwrite(eslot, 0, data)
    ^n = String.to_integer(ask.("slot:#{n}"))
    {:ok, pslot} = :file.open(Path.join(dir, "p.slot"), [:read, :raw, :binary])
    {:ok, back} = :file.pread(pslot, 0, n)
    :file.close(pslot)
    ^n = byte_size(back)
  end
}

for mib <- [1, 16, 64] do
  data = :binary.copy(<<0, 0, 128, 63>>, div(mib * 1024 * 1024, 4))
  Enum.each(ways, fn {_, f} -> f.(data) end)

  times =
    Enum.reduce(1..rounds, %{}, fn _, acc ->
      Enum.reduce(ways, acc, fn {k, f}, acc ->
        t0 = System.monotonic_time(:microsecond)
        f.(data)

        Map.update(
          acc,
          k,
          [System.monotonic_time(:microsecond) - t0],
          &[System.monotonic_time(:microsecond) - t0 | &1]
        )
      end)
    end)

  line =
    for k <- [:pipe, :fresh, :slot] do
      ms = Enum.at(Enum.sort(times[k]), div(rounds, 2)) / 1000

      "#{k} #{:erlang.float_to_binary(ms, decimals: 1)} ms #{:erlang.float_to_binary(mib * 1_048_576 / (ms / 1000) / 1.0e9, decimals: 2)} GB/s"
    end

  IO.puts(
    "#{String.pad_leading("#{mib}", 2)} MiB (median of #{rounds}): " <> Enum.join(line, ", ")
  )
end

Port.close(port)
File.rm_rf!(dir)
