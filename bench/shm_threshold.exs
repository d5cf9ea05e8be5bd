# Where shared memory starts to pay (issue 19): the tensor round trip of
# VllmBridge.Bench.Tensors (diag.echo of a float32 tensor) with every tensor through a
# slot, against the same call through the pipe only and the raw echo, in alternating
# rounds, for sizes around the threshold. Sets the threshold to 1 byte for this run.
#
#   mix run bench/shm_threshold.exs [reps] [sizes in MiB, comma-separated, 0.25 allowed]

alias VllmBridge.Bench.{Stats, Tensors}

reps = String.to_integer(Enum.at(System.argv(), 0) || "10")

sizes =
  String.split(Enum.at(System.argv(), 1) || "1,2,4,8,16,64", ",")
  |> Enum.map(&elem(Float.parse(&1), 0))

# A fresh slot directory whose threshold is 1 byte (no pool runs yet).
Application.put_env(:vllm_bridge, :shm_min_bytes, 1)
:ok = Supervisor.terminate_child(VllmBridge.Supervisor, VllmBridge.Shm)
{:ok, _} = Supervisor.restart_child(VllmBridge.Supervisor, VllmBridge.Shm)
%{min_bytes: 1} = VllmBridge.Shm.dir()

python = Application.fetch_env!(:vllm_bridge, :python)
{:ok, _} = VllmBridge.start_pool(:shm_threshold, size: 1)

rows = Tensors.run(:shm_threshold, python, sizes_mib: sizes, reps: fn _ -> reps end)
VllmBridge.stop_pool(:shm_threshold)
{load, _} = System.cmd("cat", ["/proc/loadavg"])
IO.puts("medians of #{reps}, load average #{String.trim(load)}")

IO.puts(
  "size      slots               pipe only           raw echo            slots/pipe  slots/raw"
)

for t <- rows do
  [s, p, r] = Enum.map([t.full_ms, t.pipe_ms, t.raw_ms], &(t.bytes / (&1 / 1000) / 1.0e9))
  f = fn ms, gb -> String.pad_leading("#{Stats.fmt(ms)} ms #{Stats.fmt(gb, 2)} GB/s", 19) end

  IO.puts(
    "#{String.pad_leading(Stats.fmt(t.mib, 2), 5)} MiB  #{f.(t.full_ms, s)} #{f.(t.pipe_ms, p)} #{f.(t.raw_ms, r)}" <>
      "  #{String.pad_leading(Stats.fmt(s / p, 2), 9)}x  #{String.pad_leading(Stats.fmt(s / r, 2), 8)}x"
  )
end
