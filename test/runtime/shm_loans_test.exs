defmodule VllmBridge.Runtime.ShmLoansTest do
  @moduledoc """
  Result slots of frames whose caller dies before decoding them (VllmBridge.Shm.Loans),
  on real workers: a caller killed with a large reply unread in its mailbox, and a
  stream consumer killed with large chunks unread, have their slots handed back
  (renamed `.free`) at once, and the next large result takes the same file again; and,
  over generated interleavings of callers that request, decode and die (the race of a
  caller that decoded its slot, the worker lending the same file to another caller's
  result, then the first caller dying, included), the worker's lent result slots are
  at every step exactly those named by replies live callers hold undecoded, and every
  decode gives its caller its own data.

  The workers here have reclaim and idle ages of an hour (`VLLM_BRIDGE_SHM_RECLAIM_S`,
  `VLLM_BRIDGE_SHM_IDLE_S`): no slot is reclaimed or expired while a test runs, so a
  slot that comes back can only have been handed back. Not async: it looks at the
  node's slot directory.
  """
  use ExUnit.Case, async: false
  @moduletag :capture_log

  import VllmBridge.RuntimeHelpers

  alias VllmBridge.{Shm, Tensor}
  alias VllmBridge.Call.{Request, Wire}
  alias VllmBridge.Shm.{FrameSlots, Loans}

  # 1.2 MB of float32: over the 1 MiB threshold.
  @numel 300_000

  setup do
    %{path: dir} = Shm.dir()
    {name, w} = slot_keeping_pool!("rt_shm_loans", ["rt_shm"])
    %{dir: dir, pool: name, worker: w}
  end

  defp filled(value),
    do: Tensor.new(:binary.copy(<<value + 0.0::little-float-32>>, @numel), :float32, [@numel])

  # The worker's result slots: lent (no suffix) and free, by name.
  defp lent(dir, os_pid), do: dir |> File.ls!() |> Enum.filter(&(&1 =~ ~r/\Ar-#{os_pid}-\d+\z/))

  defp results(dir, os_pid),
    do: dir |> File.ls!() |> Enum.filter(&String.starts_with?(&1, "r-#{os_pid}-")) |> Enum.sort()

  defp inode(dir, name), do: File.lstat!(Path.join(dir, name)).inode

  # A request for `filled(value)` sent straight to the worker process from the calling
  # process (its reply comes to this process's alias, and is decoded only when asked).
  defp send_filled(worker_pid, value) do
    {:ok, parts} = Wire.encode_invoke({"rt_shm", "filled"}, [@numel, value], %{})
    req = Request.new("call", pre: [Wire.value(nil)], post: parts, target: {"rt_shm", "filled"})
    Request.send_request(worker_pid, req, :infinity)
  end

  defp reply_in_mailbox?(pid) do
    case Process.info(pid, :messages) do
      {:messages, messages} -> Enum.any?(messages, &match?({_, :reply, _, _}, &1))
      nil -> false
    end
  end

  # Whether the worker process has handled `pid`'s death (its table no longer holds it).
  defp forgotten?(worker_pid, pid), do: not Map.has_key?(loans(worker_pid).callers, pid)

  defp loans(worker_pid), do: :sys.get_state(worker_pid).loans || %Loans{}

  test "a caller killed with a large reply unread has its slot handed back, then reused", %{
    dir: dir,
    pool: pool,
    worker: w
  } do
    caller =
      spawn(fn ->
        send_filled(w.pid, 1)
        Process.sleep(:infinity)
      end)

    wait_until(fn -> reply_in_mailbox?(caller) end, 60_000, "the reply is in its mailbox")
    # Lent to that reply, which nobody has decoded.
    assert [name] = lent(dir, w.os_pid)
    assert results(dir, w.os_pid) == [name]
    ino = inode(dir, name)

    Process.exit(caller, :kill)

    wait_until(
      fn -> results(dir, w.os_pid) == [name <> ".free"] end,
      15_000,
      "the slot is handed back"
    )

    # The next large result takes the same file (no new one), under a new name.
    two = filled(2)
    assert {:ok, ^two} = VllmBridge.call({"rt_shm", "filled"}, [@numel, 2], %{}, pool_name: pool)
    assert [again] = results(dir, w.os_pid)
    assert again =~ ~r/\.free\z/ and again != name <> ".free"
    assert inode(dir, again) == ino
    # Decoded names are forgotten at the worker's sweep, and their callers let go.
    wait_until(fn -> Loans.size(loans(w.pid)) == 0 end, 15_000, "the table empties")
    assert loans(w.pid).callers == %{}
  end

  test "a stream consumer killed with large chunks unread has their slots handed back", %{
    dir: dir,
    pool: pool,
    worker: w
  } do
    me = self()

    consumer =
      spawn(fn ->
        {:ok, s} = VllmBridge.stream({"rt_shm", "chunks"}, [4, @numel], %{}, pool_name: pool)

        Enum.each(s, fn _chunk ->
          send(me, :first)
          Process.sleep(:infinity)
        end)
      end)

    assert_receive :first, 60_000
    # The first chunk decoded (its slot free), the next three unread in the mailbox.
    wait_until(fn -> length(lent(dir, w.os_pid)) == 3 end, 60_000, "3 chunks unread")
    Process.exit(consumer, :kill)

    wait_until(fn -> lent(dir, w.os_pid) == [] end, 15_000, "the unread chunks' slots go back")
    # (Three files: the first chunk's was decoded, free and taken again by the fourth.)
    freed = results(dir, w.os_pid)
    assert Enum.all?(freed, &String.ends_with?(&1, ".free")), inspect(freed)
    before = freed |> Enum.map(&inode(dir, &1)) |> Enum.sort()

    # They serve again: as many large chunks as there are free files, and no new file.
    n = length(freed)
    {:ok, s} = VllmBridge.stream({"rt_shm", "chunks"}, [n, @numel], %{}, pool_name: pool)
    assert Enum.to_list(s) == Enum.map(1..n, &filled/1)
    assert results(dir, w.os_pid) |> Enum.map(&inode(dir, &1)) |> Enum.sort() == before
  end

  # -- generated interleavings -------------------------------------------------------------

  # A caller that requests, holds its reply undecoded, decodes when told; it reports
  # the result slot names its reply holds (read as the worker process reads them).
  defp caller(worker_pid, prefix) do
    receive do
      {:request, value, from} ->
        {_pid, _id, mref} = send_filled(worker_pid, value)

        {bin, origin} =
          receive do
            {^mref, :reply, bin, origin} -> {bin, origin}
          end

        send(from, {:got, self(), FrameSlots.names(bin, prefix)})

        receive do
          {:decode, from} ->
            send(from, {:decoded, self(), Wire.decode_reply(bin, origin)})
            caller(worker_pid, prefix)
        end
    end
  end

  defp spawn_caller(w), do: spawn(fn -> caller(w.pid, FrameSlots.prefix(w.os_pid)) end)

  # One step on `callers` (index => {pid, :idle | {:holding, value, names}}); returns them.
  defp step({:request, i}, callers, ctx) do
    {pid, :idle} = callers[i]
    value = System.unique_integer([:positive])
    send(pid, {:request, value, self()})
    assert_receive {:got, ^pid, names}, 60_000
    # Through a slot: never more than 3 are lent here, of the worker's 4.
    assert [_] = names, "#{inspect(ctx[:seed])} #{inspect(ctx.script)}: #{inspect(names)}"
    Map.put(callers, i, {pid, {:holding, value, names}})
  end

  defp step({:decode, i}, callers, ctx) do
    {pid, {:holding, value, _names}} = callers[i]
    send(pid, {:decode, self()})
    assert_receive {:decoded, ^pid, result}, 60_000
    # Its own data, whatever the others did meanwhile.
    expected = filled(value)

    assert {:ok, ^expected} = result,
           "#{inspect(ctx[:seed])} #{inspect(ctx.script)}: #{inspect(result, limit: 3)}"

    Map.put(callers, i, {pid, :idle})
  end

  defp step({:kill, i}, callers, ctx) do
    {pid, _} = callers[i]
    Process.exit(pid, :kill)
    wait_until(fn -> forgotten?(ctx.worker.pid, pid) end, 15_000, "its death handled")
    Map.put(callers, i, {spawn_caller(ctx.worker), :idle})
  end

  # The worker's lent result slots are exactly those of the replies held undecoded.
  defp check(callers, ctx) do
    held = for {_i, {_pid, {:holding, _, names}}} <- callers, name <- names, do: name

    assert Enum.sort(lent(ctx.dir, ctx.worker.os_pid)) == Enum.sort(held),
           "seed #{inspect(ctx[:seed])}: #{inspect(ctx.script)}"
  end

  defp run_script(script, ctx) do
    callers = Map.new(0..2, &{&1, {spawn_caller(ctx.worker), :idle}})
    ctx = Map.put(ctx, :script, script)

    callers =
      Enum.reduce(script, callers, fn s, callers ->
        callers = step(s, callers, ctx)
        check(callers, ctx)
        callers
      end)

    for {i, _} <- callers, reduce: callers, do: (callers -> step({:kill, i}, callers, ctx))
    check(%{}, ctx)
  end

  # A random script of `n` steps, each valid for the callers' state (request when idle,
  # decode when holding, kill at any time).
  defp script(n) do
    {steps, _} =
      Enum.reduce(1..n, {[], Map.new(0..2, &{&1, :idle})}, fn _, {steps, st} ->
        i = Enum.random(0..2)

        s =
          case {st[i], :rand.uniform(3)} do
            {_, 1} -> {:kill, i}
            {:idle, _} -> {:request, i}
            {:holding, _} -> {:decode, i}
          end

        next =
          case s do
            {:request, _} -> :holding
            _ -> :idle
          end

        {[s | steps], Map.put(st, i, next)}
      end)

    Enum.reverse(steps)
  end

  test "a caller that decoded, then died after its file was lent again, frees nothing",
       %{
         dir: dir,
         worker: w
       } = ctx do
    # The race itself: caller 0 decodes (its slot free), the worker lends the same file
    # to caller 1's result, then caller 0 dies: caller 1's slot stays lent, and reads.
    ctx = Map.put(ctx, :script, :race)
    callers = Map.new(0..1, &{&1, {spawn_caller(w), :idle}})
    callers = step({:request, 0}, callers, ctx)
    {_, {:holding, _, [first]}} = callers[0]
    ino = inode(dir, first)
    callers = step({:decode, 0}, callers, ctx)
    callers = step({:request, 1}, callers, ctx)
    {_, {:holding, _, [second]}} = callers[1]
    assert inode(dir, second) == ino
    callers = step({:kill, 0}, callers, ctx)
    assert lent(dir, w.os_pid) == [second]
    callers = step({:decode, 1}, callers, ctx)
    check(callers, ctx)
    # (Because the worker lent the file again under a new name.)
    assert second != first
  end

  test "generated interleavings: lent slots are exactly the undecoded replies' slots", ctx do
    seed = :rand.uniform(1_000_000_000)
    :rand.seed(:exsss, {seed, 19, 1})

    for _ <- 1..8 do
      script = script(12)
      run_script(script, Map.put(ctx, :seed, seed))
    end
  end
end
