defmodule VllmBridge.Call.All do
  @moduledoc false
  # One call on every worker of a pool (VllmBridge.call_all/5), from the caller's own
  # process: the request is encoded once, then sent to each worker in index order (a slot
  # reserved on that very worker, `{:only, i}`, as a session's call would: it waits in the
  # pool's queue while that worker is full), and only then are the replies awaited, so the
  # workers run it at the same time. Everything is under the one deadline of the runtime
  # options. A worker that is not serving when the call comes (restarting) has an error
  # as its entry at once, and one that goes down meanwhile answers `:worker_exit` (its
  # caller is told, as any caller is): an entry per worker, never a wait past the deadline.
  # References in the results belong to the calling process, as those of a plain call.

  alias VllmBridge.{Error, Pool, Ref}
  alias VllmBridge.Call.{Request, Route, Runtime, Wire}
  alias VllmBridge.Call.Span, as: CallSpan
  alias VllmBridge.Telemetry
  alias VllmBridge.Pool.Directory
  alias VllmBridge.Session.LooseRefs

  @doc "See `VllmBridge.call_all/5`."
  @spec run(term(), term(), list(), map() | keyword(), keyword()) ::
          {:ok, [term()]} | {:error, Error.t()}
  def run(pool, target, args, kwargs, opts) do
    with :ok <- own_options(pool, opts),
         :ok <- module_target(target),
         {:ok, rt} <- Runtime.resolve(opts),
         # Outside any session: the process's current one lives on one worker.
         rt = %{rt | session_id: nil, session_current?: false, pool_name: pool},
         {:ok, parts} <- Wire.encode_invoke(target, args, kwargs),
         {:ok, meta} <- Pool.meta(pool) do
      req = Request.new("call", pre: [Wire.value(nil)], post: parts, target: target)

      observed = Telemetry.enabled?()

      results =
        0..(meta.size - 1)
        |> Enum.map(&send_to(meta, &1, req, rt, target, observed))
        |> Enum.map(&await(&1, rt, target))

      # Whatever came back, references in it are the caller's (none is lost when
      # another worker failed: they are in details.results).
      LooseRefs.track(self(), Ref.collect(for({:ok, v} <- results, do: v), session: :none))

      case Enum.reject(Enum.with_index(results), &match?({{:ok, _}, _}, &1)) do
        [] -> {:ok, for({:ok, v} <- results, do: v)}
        failed -> {:error, failure(pool, target, meta.size, failed, results)}
      end
    end
  end

  defp own_options(pool, opts) when is_list(opts) do
    cond do
      not Keyword.keyword?(opts) ->
        :ok

      Keyword.get(opts, :session_id) != nil ->
        bad(
          "call_all runs on every worker of a pool, and a session lives on one: " <>
            "session_id: #{inspect(opts[:session_id], limit: 5)} is refused"
        )

      Keyword.has_key?(opts, :pool_name) and opts[:pool_name] != pool ->
        bad(
          "call_all on pool #{inspect(pool)} was given pool_name: " <>
            "#{inspect(opts[:pool_name])}, another pool"
        )

      true ->
        :ok
    end
  end

  # Not a keyword list: Runtime.resolve/1 names what is wrong.
  defp own_options(_pool, _opts), do: :ok

  defp module_target({%Ref{} = ref, _path}),
    do:
      bad(
        "call_all needs a module target {\"module\", \"function\"}; reference #{ref.id} " <>
          "(#{ref.type}) lives on one worker"
      )

  defp module_target(_target), do: :ok

  # With `:telemetry` loaded, each worker's call is a `[:vllm_bridge, :call]` span of its
  # own (VllmBridge.Telemetry): they overlap, each with its own span context.
  defp send_to(meta, i, req, rt, _target, false), do: send_to(meta, i, req, rt.deadline)

  defp send_to(meta, i, req, rt, target, true) do
    t0 = System.monotonic_time()
    route = %Route{meta: meta, constraint: {:only, i}}
    span = CallSpan.start("call", target, route, rt, t0, System.system_time())

    case send_to(meta, i, req, rt.deadline) do
      {:sent, handle} ->
        {:sent, handle, {span, i, System.monotonic_time() - t0, req.size}}

      {:error, _} = error ->
        sizes = %{
          queue_time: System.monotonic_time() - t0,
          request_bytes: req.size,
          reply_bytes: 0
        }

        CallSpan.stop(span, error, nil, sizes)
        error
    end
  end

  defp send_to(meta, i, req, deadline) do
    case Directory.worker(meta.name, i) do
      nil ->
        {:error,
         Error.new(
           :worker_exit,
           "worker #{i} of pool #{inspect(meta.name)} is not serving (restarting)"
         )}

      _serving ->
        route = %Route{meta: meta, constraint: {:only, i}}

        case Route.checkout(route, req, deadline) do
          {:ok, pid, _i} -> {:sent, Request.send_request(pid, req, deadline, holds_slot: true)}
          {:error, e} -> {:error, e}
        end
    end
  end

  defp await({:sent, handle}, rt, target),
    do: handle |> Request.await(rt.deadline) |> named(rt, target)

  defp await({:sent, handle, {span, i, queue_time, request_bytes}}, rt, target) do
    {result, reply_bytes} = Request.await_sized(handle, rt.deadline)
    result = named(result, rt, target)

    CallSpan.stop(span, result, i, %{
      queue_time: queue_time,
      request_bytes: request_bytes,
      reply_bytes: reply_bytes
    })

    result
  end

  defp await({:error, _} = error, _rt, _target), do: error

  defp named({:error, %Error{type: :timeout} = e}, rt, target),
    do:
      {:error,
       %{e | message: "call #{describe(target)}: #{e.message} (timeout #{rt.timeout} ms)"}}

  defp named(result, _rt, _target), do: result

  # The error names each worker that failed and why; the first failure gives its type
  # (and Python type and traceback); details.results has every worker's result, in order.
  defp failure(pool, target, size, failed, results) do
    [{{:error, first}, _} | _] = failed

    why =
      Enum.map_join(failed, "; ", fn {{:error, e}, i} ->
        "worker #{i}: #{Exception.message(e)}"
      end)

    %{
      first
      | message:
          "call_all #{describe(target)} on pool #{inspect(pool)}: #{length(failed)} of " <>
            "#{size} worker(s) failed (#{Enum.map_join(failed, ", ", &elem(&1, 1))}): #{why}",
        details: Map.put(first.details, :results, results)
    }
  end

  defp describe({module, path}) when is_binary(module), do: "#{module}.#{path}"
  defp describe(other), do: inspect(other, limit: 5)

  defp bad(message), do: {:error, Error.new(:bad_argument, message)}
end
