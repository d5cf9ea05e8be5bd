defmodule VllmBridge.Call.Run do
  @moduledoc false
  # The common path of every call of VllmBridge: route, reserve, send, wait. The options
  # were resolved once (VllmBridge.Call.Runtime); the arguments were encoded in the
  # caller's process before anything is reserved (VllmBridge.Call.Wire).

  alias VllmBridge.{Error, Ref, Remote}
  alias VllmBridge.Call.{Request, Route, Runtime, Wire}
  alias VllmBridge.Pool.{Directory, Slots}
  alias VllmBridge.Call.Span, as: CallSpan
  alias VllmBridge.Telemetry
  alias VllmBridge.Session.LooseRefs

  # `what:` the target the request runs (`{module, path}` or `{ref, path}`), or a short
  # description (for a release); `bound:` the reference it is bound to (nil when none);
  # `payload:` its arguments, looked at only to see whether they hold references
  # (VllmBridge.Call.Route); `timed:` whether the kind carries a timeout field (default
  # true).
  @type opts :: [what: term(), bound: Ref.t() | nil, payload: term(), timed: boolean()]

  # Kinds that clean up session state: once sent they are never cancelled (not at the
  # deadline, not when the caller dies) and carry no deadline to the worker, which runs
  # requests in arrival order. A caller that stops waiting gets :timeout, and the
  # session's next call still finds the context exited.
  @cleanups ["exit", "release"]

  @doc """
  Runs a request of `kind` whose encoded fields are `parts` (`t:opts/0`). With
  `:telemetry` loaded it runs inside a `[:vllm_bridge, :call]` span (VllmBridge.Telemetry);
  without, the one check is all it costs.
  """
  @spec run(Runtime.t(), String.t(), [iodata()], opts()) :: {:ok, term()} | {:error, Error.t()}
  def run(%Runtime{} = rt, kind, parts, opts) do
    if Telemetry.enabled?(),
      do: observed(rt, kind, parts, opts),
      else: plain(rt, kind, parts, opts)
  end

  @doc """
  Whether a request of `kind` (`bound` and `payload` as in `t:opts/0`) may carry its large
  tensors in argument slots (`VllmBridge.Shm.scope/2`'s gate): its route is a pool of this
  node whose every worker said in its hello that it reads this node's slot directory.
  The route is decided as `run/4` decides it: another node's pool, session or reference
  (whose workers cannot read this node's files), a route refused, or a pool with a
  worker that reads no directory (or is starting): false, and the tensors take the pipe.
  """
  @spec slots?(Runtime.t(), String.t(), Ref.t() | nil, term()) :: boolean()
  def slots?(%Runtime{} = rt, kind, bound, payload) do
    case Route.resolve(rt, kind, bound, payload) do
      {:ok, %Route{meta: meta}} -> VllmBridge.Shm.pool_reads?(meta)
      _ -> false
    end
  end

  @doc false
  # The request without telemetry: the lean path below, else the general one. (Public for
  # test/runtime/lean_call_test.exs, which runs it whether or not `:telemetry` is loaded.)
  @spec plain(Runtime.t(), String.t(), [iodata()], opts()) ::
          {:ok, term()} | {:error, Error.t()}
  def plain(rt, kind, parts, opts)

  # The common call, outside any session and bound to no reference (VllmBridge.call/4 and
  # the bindings pass these options in this order): any worker of the pool. The general
  # path's steps (Route.resolve/4's `:any` route, Route.checkout/3, exchange/5) with
  # nothing to decide, taken only when the pool has nobody queued, the request is within
  # its frame limit and a worker has room; otherwise, before anything is reserved, the
  # general path runs and answers (queues, refuses) as it always does. Its results are
  # the general path's (test/runtime/lean_call_test.exs).
  def plain(%Runtime{session_id: nil, node: n} = rt, "call", parts,
        what: what,
        bound: nil,
        payload: p
      )
      when n == nil or n == node() do
    with {:ok, meta} <- Directory.pool(rt.pool_name),
         req = Request.new("call", [<<0xC0>>], parts, true, what),
         true <- Slots.waiting(meta) == 0 and Request.max_size(req) <= meta.max_frame_bytes,
         i when is_integer(i) <- Slots.reserve_any(meta) do
      case Directory.worker(meta.name, i) do
        {pid, _instance} ->
          pid
          |> Request.call(req, rt.deadline, holds_slot: true)
          |> adopt_loose(%Route{meta: meta, constraint: :any})
          |> named("call", what, rt)

        nil ->
          # (Route.checkout/3's answer for a worker gone between reserve and look-up.)
          Slots.release(meta, i)
          named(Route.worker_gone(meta, i), "call", what, rt)
      end
    else
      _ -> general(rt, "call", parts, what: what, bound: nil, payload: p)
    end
  end

  def plain(rt, kind, parts, opts), do: general(rt, kind, parts, opts)

  @doc false
  # The general path alone (for the lean path's test): any request, any route.
  @spec general(Runtime.t(), String.t(), [iodata()], opts()) ::
          {:ok, term()} | {:error, Error.t()}
  def general(rt, kind, parts, opts) do
    what = Keyword.fetch!(opts, :what)

    result =
      with {:ok, route} <- resolve(rt, kind, opts),
           req = request(kind, route, parts, what, opts),
           {:ok, pid, _index} <- Route.checkout(route, req, rt.deadline) do
        exchange(pid, req, kind, route, rt)
      end

    case result do
      # Another node's pool, session or reference: the request runs there (its result,
      # a timeout included, is named there).
      {:remote, node, lost} -> Remote.run(node, rt, kind, parts, opts, lost)
      result -> named(result, kind, what, rt)
    end
  end

  # The same steps, timed: the span starts when the request enters (its metadata once the
  # route is known: pool and session), the queue time is the checkout's (waiting for
  # room on a worker), and the reply's size comes back with it. A returned error ends the
  # span with :stop and the error in its metadata; only something raised, thrown or
  # exited with in this process ends it with :exception (as Ecto and Finch do).
  defp observed(rt, kind, parts, opts) do
    what = Keyword.fetch!(opts, :what)
    t0 = System.monotonic_time()
    system_time = System.system_time()

    case resolve(rt, kind, opts) do
      # Another node's: its span is that node's (when it has :telemetry loaded).
      {:remote, node, lost} ->
        Remote.run(node, rt, kind, parts, opts, lost)

      {:ok, route} ->
        span = CallSpan.start(kind, what, route, rt, t0, system_time)

        try do
          req = request(kind, route, parts, what, opts)
          t1 = System.monotonic_time()

          case Route.checkout(route, req, rt.deadline) do
            {:ok, pid, index} ->
              queue_time = System.monotonic_time() - t1
              {result, reply_bytes} = exchange_sized(pid, req, kind, route, rt)
              result = named(result, kind, what, rt)

              CallSpan.stop(span, result, index, %{
                queue_time: queue_time,
                request_bytes: req.size,
                reply_bytes: reply_bytes
              })

              result

            {:error, _} = error ->
              result = named(error, kind, what, rt)

              CallSpan.stop(span, result, nil, %{
                queue_time: System.monotonic_time() - t1,
                request_bytes: req.size,
                reply_bytes: 0
              })

              result
          end
        catch
          class, reason ->
            CallSpan.exception(span, class, reason, __STACKTRACE__)
            :erlang.raise(class, reason, __STACKTRACE__)
        end

      {:error, _} = error ->
        # Refused before it had a route (no such pool or session, a lost reference): a
        # span of its own, so that every request that entered has one.
        result = named(error, kind, what, rt)
        span = CallSpan.start(kind, what, nil, rt, t0, system_time)
        CallSpan.stop(span, result, nil, %{queue_time: 0, request_bytes: 0, reply_bytes: 0})
        result
    end
  end

  defp resolve(rt, kind, opts),
    do: Route.resolve(rt, kind, Keyword.get(opts, :bound), Keyword.get(opts, :payload))

  defp request(kind, route, parts, what, opts),
    do: Request.new(kind, [session(route)], parts, Keyword.get(opts, :timed, true), what)

  defp session(%Route{session_id: nil}), do: <<0xC0>>
  defp session(%Route{session_id: id}), do: Wire.value(id)

  # The general path's exchange: the sized one's result (its reply size is a byte_size
  # of a frame it already has, so one path serves both).
  defp exchange(pid, req, kind, route, rt),
    do: pid |> exchange_sized(req, kind, route, rt) |> elem(0)

  # A request's exchange with its worker, and the byte size of the reply frame (0 when
  # none came).
  defp exchange_sized(pid, req, kind, _route, rt) when kind in @cleanups do
    pid
    |> Request.send_request(req, :infinity, holds_slot: true, cancel_on_caller_exit: false)
    |> Request.await_sized(rt.deadline, on_timeout: :forget)
  end

  defp exchange_sized(pid, req, _kind, route, rt) do
    {result, bytes} = Request.call_sized(pid, req, rt.deadline, holds_slot: true)
    {adopt_loose(result, route), bytes}
  end

  defp named({:error, %Error{type: :timeout} = e}, kind, what, rt),
    do: {:error, timed_out(e, kind, what, rt)}

  defp named(result, _kind, _what, _rt), do: result

  @doc "The reference a target is bound to (`{%Ref{}, path}`), or nil."
  @spec bound_ref(term()) :: Ref.t() | nil
  def bound_ref({%Ref{} = ref, _path}), do: ref
  def bound_ref(_), do: nil

  # References a call outside any session brought back belong to the calling process
  # (VllmBridge.Session.LooseRefs): released when it exits.
  # (A reply that is no list, map or tuple holds no reference: nothing to walk.)
  defp adopt_loose({:ok, value} = result, %Route{session_id: nil})
       when is_list(value) or is_map(value) or is_tuple(value) do
    LooseRefs.track(self(), Ref.collect(value, session: :none))
    result
  end

  defp adopt_loose(result, _route), do: result

  # A timeout names what timed out and the timeout it had.
  defp timed_out(e, kind, what, rt),
    do: %{e | message: "#{kind} #{describe(what)}: #{e.message} (timeout #{rt.timeout} ms)"}

  defp describe({module, path}) when is_binary(module), do: "#{module}.#{path}"
  defp describe({%Ref{} = ref, nil}), do: "reference #{ref.id} (#{ref.type})"
  defp describe({%Ref{} = ref, path}), do: "reference #{ref.id} (#{ref.type}).#{path}"
  defp describe(%Ref{} = ref), do: "of reference #{ref.id} (#{ref.type})"
  defp describe(text) when is_binary(text), do: text
end
