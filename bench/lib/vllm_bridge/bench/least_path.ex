defmodule VllmBridge.Bench.LeastPath do
  @moduledoc """
  The least the BEAM side of a call could do, on a real Python worker: the bound a
  redesign of the bridge's Elixir path could reach (issue 19;
  bench/results/least-path-and-batching.md, "The least a call could do on the BEAM").

  A process owns the port of a Python worker started as a pool starts it and runs a
  plain receive loop: it writes each request to the port, keeps `id => alias` in a map,
  cuts the port's bytes into frames, reads each reply's id from its first bytes and sends
  the frame to the alias. The caller makes a fresh id, an alias that monitors the owner,
  the request frame of the trivial call from its target's encoding made once (its
  deadline's milliseconds written per call), sends it, and waits with a deadline;
  the reply is decoded by pattern.

  What it leaves out, each a guarantee of the bridge: options and their checks, the
  pool's slots and queue, routing, sessions, shared memory, cancel on timeout or on the
  caller's death, settling a late reply, the frame limit, telemetry, references.

  `start(python, :direct)` and `call_direct/2`: the same with one process hop less, the
  bound of a redesign whose callers write to the port themselves (any process may
  `Port.command/2` a port): the caller puts `id => alias` in a public ETS table, writes
  its frame to the port and waits; the owner only cuts replies and takes each one's
  alias from the table (bench/results/caller-path.md, "Callers that write to the port").
  """

  alias VllmBridge.Call.Wire

  @target {"vllm_bridge.forward_context", "is_forward_context_available"}
  @timeout_ms 120_000

  @doc """
  Starts an owner of a new Python worker (`python` the interpreter): its handle. `how`:
  `:hop` (callers send requests to the owner) or `:direct` (callers write them).
  """
  @spec start(String.t(), :hop | :direct) :: {pid(), port()} | {pid(), port(), :ets.tid()}
  def start(python, how \\ :hop) do
    parent = self()

    pid =
      spawn_link(fn ->
        port =
          Port.open({:spawn_executable, python}, [
            {:args, ["-m", "vllm_bridge.bridge.worker"]},
            {:env, [{~c"PYTHONPATH", String.to_charlist(Path.expand("python"))}]},
            :stream,
            :binary,
            :nouse_stdio,
            :exit_status
          ])

        case how do
          :hop ->
            send(parent, {:least_port, self(), port, nil})
            loop(port, %{}, <<>>)

          :direct ->
            table = :ets.new(:least_direct, [:public, :set, write_concurrency: true])
            send(parent, {:least_port, self(), port, table})
            loop(port, table, <<>>)
        end
      end)

    receive do
      {:least_port, ^pid, port, nil} -> {pid, port}
      {:least_port, ^pid, port, table} -> {pid, port, table}
    end
  end

  @doc "The encoded fields of the trivial call after its timeout, and their size."
  @spec request() :: {iodata(), non_neg_integer()}
  def request do
    {:ok, parts} = Wire.encode_invoke(@target, [], %{})
    {parts, 1 + IO.iodata_length(parts)}
  end

  @doc "One trivial call through owner `handle`: `{:ok, boolean}`."
  @spec call({pid(), port()}, {iodata(), non_neg_integer()}) ::
          {:ok, boolean()} | {:error, term()}
  def call({pid, _port}, req) do
    {id, alias, frame} = prepare(pid, req)
    send(pid, {:submit, id, alias, frame})
    await(alias)
  end

  @doc "One trivial call written to the port by the caller itself (`start(python, :direct)`)."
  @spec call_direct({pid(), port(), :ets.tid()}, {iodata(), non_neg_integer()}) ::
          {:ok, boolean()} | {:error, term()}
  def call_direct({pid, port, table}, req) do
    {id, alias, frame} = prepare(pid, req)
    # In the table before the write: the reply cannot come before it.
    :ets.insert(table, {id, alias})
    Port.command(port, frame)
    await(alias)
  end

  # A fresh id, an alias that monitors the owner `pid`, and the request's frame (its
  # deadline's milliseconds written per call).
  defp prepare(pid, {parts, size}) do
    id = :erlang.unique_integer([:positive])
    alias = :erlang.monitor(:process, pid, [{:alias, :reply_demonitor}])
    ms = Wire.uint(@timeout_ms)
    {:ok, frame, _} = Wire.frame_request("call", id, [<<0xC0>>, ms | parts], size + byte_size(ms))
    {id, alias, frame}
  end

  defp await(alias) do
    receive do
      {:reply, ^alias, bin} -> Wire.decode_reply(bin)
      {:DOWN, ^alias, _, _, reason} -> {:error, reason}
    after
      @timeout_ms -> {:error, :timeout}
    end
  end

  @doc "The OS pid of the owner's Python worker."
  @spec os_pid(tuple()) :: integer()
  def os_pid(handle), do: elem(Port.info(elem(handle, 1), :os_pid), 1)

  defp loop(port, calls, acc) do
    receive do
      {:submit, id, alias, frame} ->
        Port.command(port, frame)
        loop(port, Map.put(calls, id, alias), acc)

      {^port, {:data, data}} ->
        {calls, rest} = frames(acc <> data, calls)
        loop(port, calls, rest)

      {^port, {:exit_status, status}} ->
        exit({:worker_exited, status})
    end
  end

  defp frames(<<len::32, body::binary-size(len), rest::binary>>, calls) do
    case Wire.peek(body) do
      {:ok, id} when is_map(calls) ->
        {alias, calls} = Map.pop(calls, id)
        send(alias, {:reply, alias, body})
        frames(rest, calls)

      {:ok, id} ->
        [{_, alias}] = :ets.take(calls, id)
        send(alias, {:reply, alias, body})
        frames(rest, calls)

      # (The hello, and anything else without a caller.)
      _ ->
        frames(rest, calls)
    end
  end

  defp frames(rest, calls), do: {calls, rest}
end
