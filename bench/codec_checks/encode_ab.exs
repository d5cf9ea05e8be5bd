# The old codec (Old.*), written to $OLD_DIR by run.sh, beside the current one.
for f <- ~w(old_msgpack old_dataclass old_ext old_codec old_wire),
    do: Code.require_file(Path.join(System.fetch_env!("OLD_DIR"), "#{f}.ex"))

cases = [
  {"add(1, 2)", {"vllm_bridge.bridge.diag", "add"}, [1, 2], %{}},
  {"kwargs + map arg", {"vllm_bridge.bridge.diag", "echo"},
   [%{"a" => 1, "b" => [1, 2, 3], "c" => %{x: 1}}], [k: 1, j: 2]},
  {"atom-keyed map of 20", {"vllm_bridge.bridge.diag", "echo"},
   [Map.new(1..20, &{:"k#{&1}", &1})], []},
  {"1k ints", {"vllm_bridge.bridge.diag", "echo"}, [Enum.to_list(1..1000)], []},
  {"mixed keys", {"vllm_bridge.bridge.diag", "echo"},
   [%{1 => :a, "b" => 2, :c => 3.5, {1, 2} => nil}], []}
]

run = fn mod, {_, t, a, k}, n ->
  {us, _} =
    :timer.tc(fn ->
      for _ <- 1..n, do: mod.encode_invoke(t, a, k) |> elem(1) |> IO.iodata_to_binary()
    end)

  us / n
end

med = fn l -> Enum.at(Enum.sort(l), div(length(l), 2)) end

for c <- cases do
  n = if elem(c, 0) == "1k ints", do: 2000, else: 20000

  {o, w} =
    Enum.reduce(1..7, {[], []}, fn _, {o, w} ->
      {[run.(Old.Wire, c, n) | o], [run.(VllmBridge.Call.Wire, c, n) | w]}
    end)

  IO.puts(
    "#{String.pad_trailing(elem(c, 0), 22)} old #{Float.round(med.(o), 3)} us  new #{Float.round(med.(w), 3)} us  (#{Float.round(med.(w) - med.(o), 3)})"
  )
end
