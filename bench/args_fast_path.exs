# The fast path that VllmBridge.Bindings.Args.split had (`quick/2`, removed in issue 14):
# what it saved. Times `split/2` on the argument shapes of common calls with the current
# Args and with the Args of a git revision given by `--against` (compiled in this run
# under other names: as it was, and with its fast path cut off, so that `split` takes its
# general path alone), beside the time of a whole generated call through a worker
# (is_forward_context_available/1, the round trip of `make bench`).
#
#     mix run bench/args_fast_path.exs [--against REV] [--calls N]
#       # REV: a revision whose args.ex has the fast path, e.g. 907fd3b; N default 200 000
#
# With `--against`, the variants must also answer alike (result or error message) on
# 100 000 generated calls (random parameter lists of every mode and type, arguments that
# fit them and arguments that do not), seeded: the run stops on the first difference.
#
# Not part of `make bench`. Figures: bench/results/fast-paths.md, "Args fast path".

defmodule VllmBridge.Bench.ArgsFastPath do
  alias VllmBridge.Bindings.Args

  @pool :vllm_bench_args

  def run(opts) do
    calls = Keyword.get(opts, :calls, 200_000)
    variants = [{"now", Args} | against(opts[:against])]

    IO.puts("split/2, ns per call (median of 5 rounds of #{calls}):")

    IO.puts(
      "  " <> String.pad_trailing("shape", 38) <> Enum.map_join(variants, &pad(elem(&1, 0), 16))
    )

    for {label, spec, args} <- shapes() do
      # Every variant answers alike on these inputs.
      answers = for {_, module} <- variants, do: module.split(spec, args)
      true = Enum.all?(answers, &(&1 == hd(answers)))
      times = for {_, module} <- variants, do: per_call(fn -> module.split(spec, args) end, calls)
      IO.puts("  " <> String.pad_trailing(label, 38) <> Enum.map_join(times, &pad(&1, 16)))
    end

    {:ok, _} = VllmBridge.start_pool(@pool, size: 1)
    :ok = VllmBridge.Pool.await_ready(@pool, 120_000)
    rt = [__runtime__: [pool_name: @pool]]

    for _ <- 1..2000,
        do: {:ok, false} = Vllm.ForwardContext.Module.is_forward_context_available(rt)

    samples =
      for _ <- 1..5000 do
        t0 = System.monotonic_time(:nanosecond)
        {:ok, false} = Vllm.ForwardContext.Module.is_forward_context_available(rt)
        System.monotonic_time(:nanosecond) - t0
      end

    :ok = VllmBridge.stop_pool(@pool)
    IO.puts("whole call is_forward_context_available/1 (p50 of 5000): #{median(samples)} ns")
    if length(variants) > 1, do: agree(variants, 100_000)
  end

  defp agree(variants, n) do
    :rand.seed(:exsss, {14, 14, 14})

    oks =
      Enum.count(1..n, fn _ ->
        {spec, args, more} = VllmBridge.Bench.ArgsGen.call()
        [first | _] = answers = for {_, m} <- variants, do: m.split(spec, args, more)

        unless Enum.all?(answers, &(&1 == first)),
          do: raise("the variants differ on #{inspect({spec, args, more})}: #{inspect(answers)}")

        elem(first, 0) == :ok
      end)

    IO.puts("answers alike on #{n} generated calls (#{oks} accepted, #{n - oks} refused)")
  end

  # The fast path stays compiled (no unused-function warning) but is never taken.
  @general_only "case (if :erlang.phash2(1) == -1, do: quick(spec.params, args), else: :slow) do"

  defp against(nil), do: []

  defp against(rev) do
    {source, 0} = System.cmd("git", ["show", "#{rev}:lib/vllm_bridge/bindings/args.ex"])
    fast = "case quick(spec.params, args) do"
    unless String.contains?(source, fast), do: raise("#{rev}'s args.ex has no fast path")

    [
      {"#{rev} fast", compile(source, ArgsThen)},
      {"#{rev} general", compile(String.replace(source, fast, @general_only), ArgsThenGeneral)}
    ]
  end

  defp compile(source, name) do
    source =
      String.replace(
        source,
        "defmodule VllmBridge.Bindings.Args do",
        "defmodule #{inspect(name)} do"
      )

    Code.compile_string(source, "#{name}.ex")
    name
  end

  # The specs of three generated functions, as their modules hold them (module attributes
  # of lib/vllm/forward_context/module.ex; create_forward_context's optional ones are `:any`
  # here: the fast path never reads them).
  defp shapes do
    s = %{
      name: "Vllm.ForwardContext.Module.is_forward_context_available",
      params: [],
      target: {"vllm_bridge.forward_context", "is_forward_context_available"}
    }

    sp = %{
      name: "Vllm.ForwardContext.Module._compute_sp_num_tokens",
      params: [
        {:num_tokens_across_dp_cpu, :required, {:union, [:tensor, {:list, :int}]}},
        {:sequence_parallel_size, :required, :int}
      ],
      target: {"vllm_bridge.forward_context", "_compute_sp_num_tokens"}
    }

    optional = for name <- ~w(a b c d e f g h)a, do: {name, :optional, :any}

    cf = %{
      name: "Vllm.ForwardContext.Module.create_forward_context",
      params: [
        {:attn_metadata, :required, :any},
        {:vllm_config, :required, {:struct, Vllm.Config.VllmConfig}} | optional
      ],
      target: {"vllm_bridge.forward_context", "create_forward_context"}
    }

    rt = [__runtime__: [timeout: 5_000]]

    [
      {"no parameters, no options", s, []},
      {"no parameters, [__runtime__: ...]", s, [rt]},
      {"2 required ([5, 3], 2)", sp, [[5, 3], 2]},
      {"2 required, 8 optional; 2 given + rt", cf, [nil, %Vllm.Config.VllmConfig{}, rt]}
    ]
  end

  defp per_call(fun, calls) do
    rounds =
      for _ <- 1..5 do
        t0 = System.monotonic_time(:nanosecond)
        loop(fun, calls)
        div(System.monotonic_time(:nanosecond) - t0, calls)
      end

    median(rounds)
  end

  defp loop(_fun, 0), do: :ok

  defp loop(fun, n) do
    fun.()
    loop(fun, n - 1)
  end

  defp median(xs), do: xs |> Enum.sort() |> Enum.at(div(length(xs), 2))
  defp pad(x, width), do: String.pad_leading(to_string(x), width)
end

defmodule VllmBridge.Bench.ArgsGen do
  # A generated function's spec and a call of it: half the calls fit the spec (required
  # values of the right type, some optional ones positionally, options by name, runtime
  # options), half are drawn from awkward values (keyword lists, [], lists of pairs).
  @types [:int, :any, :str, {:list, :int}, :bool, {:union, [:int, :none]}]
  @modes [:required, :required_keyword, :optional, :positional_only, :keyword]
  @names ~w(a b c d e f)a

  def call do
    params =
      @names
      |> Enum.take(Enum.random(0..5))
      |> Enum.map(&{&1, Enum.random(@modes), Enum.random(@types)})

    spec = %{name: "M.f", target: {"m", "f"}, params: params}
    spec = if :rand.uniform(4) == 1, do: Map.put(spec, :var_keyword, true), else: spec
    args = if :rand.uniform(2) == 1, do: fitting(params), else: awkward()
    {spec, args, Enum.random([0, 0, 1])}
  end

  defp fitting(params) do
    fixed = for {_, m, t} <- params, m in [:required, :required_keyword], do: of(t)
    pos = for {_, m, t} <- params, m in [:optional, :positional_only], do: of(t)
    pos = Enum.take(pos, Enum.random(0..length(pos)))

    opts =
      for {name, m, t} <- params,
          m in [:optional, :keyword],
          :rand.uniform(2) == 1,
          do: {name, of(t)}

    opts = if :rand.uniform(2) == 1, do: opts ++ [__runtime__: [timeout: 1]], else: opts
    fixed ++ pos ++ Enum.random([[], [opts], [Enum.shuffle(opts)]])
  end

  defp awkward do
    args = for _ <- 0..Enum.random(0..6)//1, do: value()

    if :rand.uniform(2) == 1 do
      opts =
        for _ <- 0..Enum.random(0..3)//1,
            do: {Enum.random(@names ++ [:__runtime__, :zz]), value()}

      Enum.take(args, Enum.random(0..6)) ++ [opts]
    else
      args
    end
  end

  defp value do
    Enum.random([
      1,
      "s",
      [1, 2],
      true,
      nil,
      [],
      [a: 1],
      [__runtime__: []],
      [b: 2, b: 3],
      [{:c, 1}, 5],
      %{},
      2.5
    ])
  end

  defp of(:int), do: 3
  defp of(:any), do: Enum.random([nil, [a: 1], []])
  defp of(:str), do: "x"
  defp of({:list, :int}), do: [1]
  defp of(:bool), do: false
  defp of({:union, _}), do: nil
end

{opts, [], []} = OptionParser.parse(System.argv(), strict: [against: :string, calls: :integer])
VllmBridge.Bench.ArgsFastPath.run(opts)
