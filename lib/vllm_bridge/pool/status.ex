defmodule VllmBridge.Pool.Status do
  @moduledoc """
  What `VllmBridge.Pool.status/2` returns: a pool and each of its workers, as they are now.

  Where each figure comes from (nothing of it sits on a call's path):

    * the worker's Elixir process (asked with a `GenServer.call`; it never waits on
      Python): `pid`, `os_pid`, `device`, whether it is still starting, its calls in
      flight and their targets;
    * the Python process (a `ping`, answered by its reader thread, also while a long call
      runs; docs/PROTOCOL.md): which request runs and for how long, `queued`, `sessions`,
      `refs`, and CUDA memory when CUDA is initialised there;
    * the pool: `restarts` (its supervisor's restarts of that index) and `waiting` (callers
      queued for a worker);
    * `/proc/<os_pid>/status` (Linux): `rss_bytes`.

  A figure that could not be had is `nil`: a worker still starting is not pinged, and one
  whose Python process does not answer its ping within the status's `:timeout` (its
  reader thread is starved: C code holding the GIL) has `sessions`, `refs`, `queued`,
  `cuda_allocated` and `cuda_reserved` nil and `running` from its Elixir side alone.
  """

  alias VllmBridge.Pool.Slots

  defmodule Worker do
    @moduledoc """
    One worker of a `VllmBridge.Pool.Status`.

    | field | meaning |
    |---|---|
    | `index` | the worker's index in its pool |
    | `pid` | its Elixir process (`nil` while the pool's supervisor restarts it) |
    | `os_pid` | its Python process's OS pid |
    | `device` | `"cpu"` or `"cuda:N"` (from its handshake; `nil` before) |
    | `state` | `:starting` (handshake or `on_start` not done), `:ready` (nothing runs), `:running` (a request runs), `:failed` (its first start failed; the pool is being stopped) |
    | `running` | the running request: `%{id, kind, target, age_ms}` (`kind` `"call"`, `"get"`, `"stream"`, `"enter"`, `"exit"`...; `target` `{module, name}` or a reference target; `age_ms` how long it has run, from the Python side), or `nil` |
    | `in_flight` | requests sent to it and not answered yet (the running one included) |
    | `queued` | requests waiting in the Python process behind the running one |
    | `sessions` | sessions it holds state for |
    | `refs` | object references it holds |
    | `restarts` | how many times this index was started again since the pool started |
    | `rss_bytes` | its Python process's resident memory |
    | `cuda_allocated`, `cuda_reserved` | bytes of CUDA memory its caching allocator has allocated / reserved on its device; `nil` on a CPU worker, or before anything initialised CUDA there |
    """

    @enforce_keys [:index]
    defstruct [
      :index,
      :pid,
      :os_pid,
      :device,
      :state,
      :running,
      :in_flight,
      :queued,
      :sessions,
      :refs,
      :restarts,
      :rss_bytes,
      :cuda_allocated,
      :cuda_reserved
    ]

    @type t :: %__MODULE__{
            index: non_neg_integer(),
            pid: pid() | nil,
            os_pid: non_neg_integer() | nil,
            device: String.t() | nil,
            state: :starting | :ready | :running | :failed | nil,
            running:
              %{
                id: non_neg_integer(),
                kind: String.t() | nil,
                target: term(),
                age_ms: non_neg_integer() | nil
              }
              | nil,
            in_flight: non_neg_integer() | nil,
            queued: non_neg_integer() | nil,
            sessions: non_neg_integer() | nil,
            refs: non_neg_integer() | nil,
            restarts: non_neg_integer(),
            rss_bytes: non_neg_integer() | nil,
            cuda_allocated: non_neg_integer() | nil,
            cuda_reserved: non_neg_integer() | nil
          }
  end

  @enforce_keys [:pool, :size, :waiting, :workers]
  defstruct [:pool, :size, :waiting, :workers]

  @typedoc """
  `pool` its name, `size` its workers, `waiting` callers queued for a worker (all busy),
  `workers` by index.
  """
  @type t :: %__MODULE__{
          pool: term(),
          size: pos_integer(),
          waiting: non_neg_integer(),
          workers: [__MODULE__.Worker.t()]
        }

  @doc false
  # The status of the pool with `meta` (VllmBridge.Pool.status/2 checked it is started).
  @spec collect(VllmBridge.Pool.Meta.t(), timeout()) :: t()
  def collect(meta, timeout) do
    pids = worker_pids(meta.name)

    workers =
      0..(meta.size - 1)
      |> Enum.map(fn i -> {i, Map.get(pids, i)} end)
      |> Task.async_stream(fn {i, pid} -> worker(meta, i, pid, timeout) end,
        timeout: :infinity,
        ordered: true
      )
      |> Enum.map(fn {:ok, w} -> w end)

    %__MODULE__{
      pool: meta.name,
      size: meta.size,
      waiting: Slots.waiting(meta),
      workers: workers
    }
  end

  defp worker_pids(name) do
    for {{VllmBridge.Worker, i}, pid, _, _} <-
          Supervisor.which_children(VllmBridge.Pool.Supervisor.via(name)),
        is_pid(pid),
        into: %{},
        do: {i, pid}
  catch
    :exit, _ -> %{}
  end

  defp worker(meta, i, pid, timeout) do
    base = %__MODULE__.Worker{index: i, pid: pid, restarts: restarts(meta, i)}

    with pid when is_pid(pid) <- pid,
         {:ok, local} <- local(pid, timeout) do
      w = %{
        base
        | os_pid: local.os_pid,
          device: local.device,
          in_flight: local.in_flight,
          rss_bytes: rss(local.os_pid)
      }

      case local.phase do
        :ready -> ready(w, pid, local, timeout)
        :failed -> %{w | state: :failed}
        _starting -> %{w | state: :starting}
      end
    else
      _ -> %{base | pid: nil, state: :starting}
    end
  end

  # The worker's Elixir side, its requests only: a message in its table (a nil target) is
  # no request, and a ping (a concurrent status's, say) must not count in in_flight nor be
  # reported as the running request.
  defp local(pid, timeout) do
    local = Elixir.VllmBridge.Worker.local_status(pid, timeout)

    {:ok,
     %{local | calls: for({id, what} <- local.calls, what != nil, into: %{}, do: {id, what})}}
  catch
    :exit, _ -> :error
  end

  defp ready(w, pid, local, timeout) do
    case Elixir.VllmBridge.Worker.ping(pid, timeout) do
      {:ok, %{} = pong} ->
        cuda = pong["cuda"] || %{}
        # The worker's table read again, after the pong: a request Python runs was sent
        # through the worker process before the ping was, so it is in the table now
        # unless it has finished meanwhile (then nothing runs, as far as this status can
        # tell).
        calls =
          case local(pid, timeout) do
            {:ok, again} -> again.calls
            :error -> local.calls
          end

        running =
          if Map.has_key?(calls, pong["running"]),
            do: running(pong["running"], pong["running_for"], calls)

        %{
          w
          | state: if(running, do: :running, else: :ready),
            in_flight: map_size(calls),
            running: running,
            queued: pong["queued"],
            sessions: pong["sessions"],
            refs: pong["refs"],
            cuda_allocated: cuda["allocated"],
            cuda_reserved: cuda["reserved"]
        }

      _no_pong ->
        # Its Elixir side alone: the oldest call in flight is the one that runs (Python
        # runs them in arrival order, and ids grow).
        case Enum.min_by(local.calls, &elem(&1, 0), fn -> nil end) do
          nil -> %{w | state: :ready}
          {id, what} -> %{w | state: :running, running: running(id, nil, %{id => what})}
        end
    end
  end

  defp running(nil, _for, _calls), do: nil

  defp running(id, seconds, calls) do
    {kind, target} =
      case Map.get(calls, id) do
        {kind, target} -> {kind, target}
        _ -> {nil, nil}
      end

    age = if is_number(seconds), do: round(seconds * 1000)
    %{id: id, kind: kind, target: target, age_ms: age}
  end

  defp restarts(%{starts: nil}, _i), do: 0
  defp restarts(%{starts: starts}, i), do: max(:atomics.get(starts, i + 1) - 1, 0)

  @doc false
  # Resident memory of an OS process (Linux /proc), nil where it cannot be read.
  @spec rss(non_neg_integer() | nil) :: non_neg_integer() | nil
  def rss(nil), do: nil

  def rss(os_pid) do
    with {:ok, text} <- File.read("/proc/#{os_pid}/status"),
         [_, kb] <- Regex.run(~r/^VmRSS:\s+(\d+)\s+kB/m, text) do
      String.to_integer(kb) * 1024
    else
      _ -> nil
    end
  end
end
