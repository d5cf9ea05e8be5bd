# What a call to a pool on another node costs (issue 20): the trivial call
# (`vllm_bridge.bridge.diag.add(1, 2)`) to a pool of 1 worker on this node and to one on a
# peer node on 127.0.0.1 (OTP's :peer, this build's code path), one caller, alternating
# rounds; p50 and p99 of each. The remote call runs the local call in a process spawned
# on the peer (VllmBridge.Remote), so it costs the local call plus a spawn, the go (the
# spawned process starts nothing before the caller answers its spawn reply: a request
# given up on never starts late) and the answer, over the distribution connection.
#
# Then the go's price alone, in the same run: a process spawned on the peer that answers
# at once, against one that answers after the caller's go on its spawn reply, as
# VllmBridge.Remote.spawn_proxy/3 and VllmBridge.Remote.Proxy do it (alternating rounds).
#
#   mix run bench/remote_call.exs [calls rounds]      (defaults 2 000 calls in 5 rounds)

alias VllmBridge.Bench.Stats

[calls, rounds] =
  case System.argv() do
    [] -> [2_000, 5]
    [c, r] -> Enum.map([c, r], &String.to_integer/1)
  end

# The go's price alone: the spawned process's code, loaded on the peer below (this
# script's modules are this node's); defined before this node is distributed (the
# compiler's processes are this node's as it was then).
{:module, echo, echo_bin, _} =
  defmodule RemoteCallBench.Echo do
    @moduledoc false
    def at_once(to, tag), do: send(to, {tag, :done})

    def after_go(to, tag) do
      receive do
        {:go, ^tag} -> send(to, {tag, :done})
      end
    end

    # `calls` spawns of `fun` on `node`, each to its answer, as spawn_proxy/3 waits: us.
    def time(node, fun, calls), do: for(_ <- 1..calls, do: once(node, fun))

    defp once(node, fun) do
      t0 = System.monotonic_time()
      tag = :erlang.alias([:explicit_unalias])
      req = :erlang.spawn_request(node, __MODULE__, fun, [self(), tag], [:monitor])
      pid = spawn_reply(req)
      if fun == :after_go, do: send(pid, {:go, tag})
      done(tag)
      :erlang.unalias(tag)
      Process.demonitor(req, [:flush])
      System.convert_time_unit(System.monotonic_time() - t0, :native, :nanosecond) / 1000
    end

    defp spawn_reply(req) do
      receive do
        {:spawn_reply, ^req, :ok, pid} -> pid
      end
    end

    defp done(tag) do
      receive do
        {^tag, :done} -> :ok
      end
    end
  end

_ = System.cmd("epmd", ["-daemon"])
{:ok, _} = Node.start(:"bench#{System.unique_integer([:positive])}@127.0.0.1", :longnames)

{:ok, peer, node} =
  :peer.start(%{
    name: :"bench_peer#{System.unique_integer([:positive])}",
    host: ~c"127.0.0.1",
    longnames: true,
    args:
      [~c"-setcookie", Atom.to_charlist(Node.get_cookie())] ++
        Enum.flat_map(:code.get_path(), &[~c"-pa", &1])
  })

for {k, v} <- Application.get_all_env(:vllm_bridge),
    do: :ok = :erpc.call(node, Application, :put_env, [:vllm_bridge, k, v])

{:ok, _} = :erpc.call(node, Application, :ensure_all_started, [:vllm_bridge])
{:ok, _} = :erpc.call(node, VllmBridge, :start_pool, [:remote_bench, [size: 1]], 120_000)
{:ok, _} = VllmBridge.start_pool(:local_bench, size: 1)

target = {"vllm_bridge.bridge.diag", "add"}

time = fn pool ->
  for _ <- 1..calls do
    t0 = System.monotonic_time()
    {:ok, 3} = VllmBridge.call(target, [1, 2], %{}, pool_name: pool)
    System.convert_time_unit(System.monotonic_time() - t0, :native, :nanosecond) / 1000
  end
end

# Warm both paths, then alternate.
time.(:local_bench)
time.(:remote_bench)

{local, remote} =
  Enum.reduce(1..rounds, {[], []}, fn _, {l, r} ->
    {l ++ time.(:local_bench), r ++ time.(:remote_bench)}
  end)

p = fn s, q -> Stats.fmt(Stats.percentile(s, q)) end

IO.puts("p50 local/remote: #{p.(local, 50)} / #{p.(remote, 50)} us")
IO.puts("p99 local/remote: #{p.(local, 99)} / #{p.(remote, 99)} us")

{:module, ^echo} = :erpc.call(node, :code, :load_binary, [echo, ~c"remote_call.exs", echo_bin])

echo.time(node, :at_once, calls)
echo.time(node, :after_go, calls)

{at_once, after_go} =
  Enum.reduce(1..rounds, {[], []}, fn _, {a, g} ->
    {a ++ echo.time(node, :at_once, calls), g ++ echo.time(node, :after_go, calls)}
  end)

IO.puts("p50 spawn+answer without/with go: #{p.(at_once, 50)} / #{p.(after_go, 50)} us")
IO.puts("p99 spawn+answer without/with go: #{p.(at_once, 99)} / #{p.(after_go, 99)} us")

:peer.stop(peer)
