# What VllmBridge.Shm.scope/2 costs a call that sends no large tensor (issue 19, review
# M5): the encoding of a call's arguments (VllmBridge.Call.Wire.encode_invoke/3) with and
# without the scope around it, for arguments without a tensor and with 1 or 8 small
# (below the threshold) tensors. No worker runs: this is the caller-side cost alone.
# Alternating rounds; per call, the median and range over the rounds. `checked`: the
# encoding as VllmBridge.Call.Run.run_encoded/4 does it since the plain-data check
# (VllmBridge.Shm.Writer.plain?/1): arguments without a struct are encoded bare, others
# in the scope.
#
#   mix run bench/shm_scope_cost.exs [rounds] [calls per round]

alias VllmBridge.Call.Wire

rounds = String.to_integer(Enum.at(System.argv(), 0) || "7")
n = String.to_integer(Enum.at(System.argv(), 1) || "200000")
target = {"vllm_bridge.bridge.diag", "echo"}
small = VllmBridge.Tensor.new(:binary.copy(<<1, 2, 3, 4>>, 64), :int32, [64])
gate = fn -> true end

cases = [
  {"no arguments", []},
  {"no tensor", [1, "two", %{"three" => 3.0}]},
  {"1 small tensor", [small]},
  {"8 small tensors", List.duplicate(small, 8)}
]

per_call = fn fun ->
  {us, _} =
    :timer.tc(fn ->
      Enum.each(1..n, fn _ -> fun.() end)
    end)

  us * 1000 / n
end

for {label, args} <- cases do
  bare = fn -> {:ok, _} = Wire.encode_invoke(target, args, %{}) end

  scoped = fn ->
    VllmBridge.Shm.scope(gate, fn -> {:ok, _} = Wire.encode_invoke(target, args, %{}) end)
  end

  checked = fn ->
    if VllmBridge.Shm.Writer.plain?({args, %{}}), do: bare.(), else: scoped.()
  end

  {b, s, c} =
    Enum.map(1..rounds, fn _ -> {per_call.(bare), per_call.(scoped), per_call.(checked)} end)
    |> Enum.reduce({[], [], []}, fn {x, y, z}, {xs, ys, zs} -> {[x | xs], [y | ys], [z | zs]} end)

  diffs = Enum.zip_with(b, s, &(&2 - &1))
  med = fn xs -> xs |> Enum.sort() |> Enum.at(div(length(xs), 2)) end
  r = fn xs -> "#{Float.round(Enum.min(xs), 0)}-#{Float.round(Enum.max(xs), 0)}" end

  IO.puts(
    "#{String.pad_trailing(label, 16)} bare #{Float.round(med.(b), 0)} ns (#{r.(b)}), " <>
      "in scope #{Float.round(med.(s), 0)} ns (#{r.(s)}), scope costs #{Float.round(med.(diffs), 0)} ns (#{r.(diffs)}), " <>
      "checked #{Float.round(med.(c), 0)} ns (#{r.(c)})"
  )
end

{load, _} = System.cmd("cat", ["/proc/loadavg"])
IO.puts("#{rounds} rounds of #{n} calls, load average #{String.trim(load)}")
