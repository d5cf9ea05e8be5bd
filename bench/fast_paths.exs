# The call path's fast paths beside their general paths, in one run (issue 14): what each
# saves per call. Run: MIX_ENV=test mix run bench/fast_paths.exs
#
#   * VllmBridge.Call.Runtime.resolve/2: the one-pass path (no `:runtime` config, plain
#     values) against the general path (forced by a `:runtime` config that changes
#     nothing), for the options a call usually carries;
#   * VllmBridge.Call.Wire.peek/1 (the kind and id read from the first bytes) against
#     the general path (a full decode), for the frames a worker process routes.
#
# Each subject runs in rounds that alternate with its peer; the figure is the median of
# the rounds' per-call time.

alias VllmBridge.Call.{Runtime, Wire}
alias VllmBridge.Codec

defmodule FastPathBench do
  def per_call_us(fun, n) do
    {us, _} = :timer.tc(fn -> loop(fun, n) end)
    us / n
  end

  # `fun` called n times: the microseconds it took.
  def loop_n(fun, n) do
    {us, _} = :timer.tc(fn -> loop(fun, n) end)
    us
  end

  # Alternating rounds of two timed functions (each returns its microseconds).
  def compare_rounds(a, b, rounds \\ 9) do
    {as, bs} = Enum.reduce(1..rounds, {[], []}, fn _, {as, bs} -> {[a.() | as], [b.() | bs]} end)

    {median(as), median(bs)}
  end

  defp loop(_fun, 0), do: :ok

  defp loop(fun, n) do
    fun.()
    loop(fun, n - 1)
  end

  # Alternating rounds of `a` and `b`: the median per-call time of each.
  def compare(a, b, n, rounds \\ 9) do
    {as, bs} =
      Enum.reduce(1..rounds, {[], []}, fn _, {as, bs} ->
        {[per_call_us(a, n) | as], [per_call_us(b, n) | bs]}
      end)

    {median(as), median(bs)}
  end

  defp median(xs), do: xs |> Enum.sort() |> Enum.at(div(length(xs), 2))

  def row(label, {fast, general}) do
    figures = :io_lib.format("~8.3f us ~10.3f us ~8.1fx", [fast, general, general / fast])
    IO.puts(String.pad_trailing(label, 52) <> to_string(figures))
  end
end

IO.puts(String.pad_trailing("subject", 52) <> "    fast    general    saved")

Application.delete_env(:vllm_bridge, :runtime)

runtime_cases = [
  {"resolve []", []},
  {"resolve [timeout: 5000]", [timeout: 5_000]},
  {"resolve [session_id: \"s\", affinity: :hint]", [session_id: "s", affinity: :hint]},
  {"resolve [pool_name: :p, timeout: 5000, stream_timeout: 9]",
   [pool_name: :p, timeout: 5_000, stream_timeout: 9]}
]

# The general path: a :runtime config that changes nothing, set around its rounds.
general_config = fn fun ->
  fn ->
    Application.put_env(:vllm_bridge, :runtime, affinity: :strict_queue)
    result = fun.()
    Application.delete_env(:vllm_bridge, :runtime)
    result
  end
end

for {label, opts} <- runtime_cases do
  n = 20_000
  resolve_n = fn -> FastPathBench.loop_n(fn -> {:ok, _} = Runtime.resolve(opts) end, n) end
  {fast, general} = FastPathBench.compare_rounds(resolve_n, general_config.(resolve_n))
  FastPathBench.row(label, {fast / n, general / n})
end

frame = fn term -> IO.iodata_to_binary(Codec.encode(term)) end

peek_cases = [
  {"peek [\"ok\", id, false]", frame.(["ok", 123_456_789, false])},
  {"peek [\"ok\", id, 1 KiB str]", frame.(["ok", 123_456_789, String.duplicate("a", 1024)])},
  {"peek [\"chunk\", id, a map of 100 ints]",
   frame.(["chunk", 123_456_789, Map.new(1..100, &{Integer.to_string(&1), &1})])},
  {"peek [\"ok\", id, 1 MiB float32 tensor]",
   frame.([
     "ok",
     123_456_789,
     VllmBridge.Tensor.new(:binary.copy(<<0, 0, 128, 63>>, 262_144), :float32, [262_144])
   ])},
  {"peek [\"end\", id]", frame.(["end", 123_456_789])}
]

for {label, bin} <- peek_cases do
  n = if byte_size(bin) > 100_000, do: 200, else: 20_000
  times = FastPathBench.compare(fn -> Wire.peek(bin) end, fn -> Wire.peek_general(bin) end, n)
  FastPathBench.row(label, times)
end
