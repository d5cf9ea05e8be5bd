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
  # true); `route:` the route already resolved for it (`run_encoded/4`: the one its
  # arguments were encoded for), else it is resolved here.
  @type opts :: [
          what: term(),
          bound: Ref.t() | nil,
          payload: term(),
          timed: boolean(),
          route: {:ok, Route.t()} | {:remote, node(), atom()} | {:error, Error.t()}
        ]

  # Kinds that clean up session state: once sent they are never cancelled (not at the
  # deadline, not when the caller dies) and carry no deadline to the worker, which runs
  # requests in arrival order. A caller that stops waiting gets :timeout, and the
  # session's next call still finds the context exited.
  @cleanups ["exit", "release"]

  # The first part of the key of the route the gate of run_encoded/4 resolved (the second
  # a reference of that call's own).
  @route {__MODULE__, :route}

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
  Runs a request of `kind` whose arguments `encode` encodes, inside
  `VllmBridge.Shm.scope/2`: its large tensors go into argument slots when its route is a
  pool of this node whose every worker said in its hello that it reads this node's slot
  directory (`slots?/1`), else through the pipe. The route is resolved once: by the
  scope's gate when a tensor over the threshold of its arguments asks it, and the
  request then runs on that route (`run/4`'s `route:`), so that where the tensors went
  and where the request goes cannot disagree; by `run/4` otherwise. The gate's route is
  this call's alone: once the arguments are encoded the gate resolves nothing and the
  scope lends no more slots (a tensor encoded later in the scope, by a `:telemetry`
  handler, say, takes the pipe), and nothing of it outlives the call.
  """
  @spec run_encoded(
          Runtime.t(),
          String.t(),
          (() -> {:ok, [iodata()]} | {:error, Error.t()}),
          opts()
        ) :: {:ok, term()} | {:error, Error.t()}
  def run_encoded(%Runtime{} = rt, kind, encode, opts) do
    # Arguments of plain data (no struct: only a tensor takes a slot) can lend no slot:
    # they are encoded and run without the scope, its gate and its route key, which cost
    # a small call 0.3-0.45 us (bench/results/least-path-and-batching.md, "A call's plain
    # arguments skip the slot scope").
    if VllmBridge.Shm.Writer.plain?(Keyword.get(opts, :payload)) do
      with {:ok, parts} <- encode.(), do: run(rt, kind, parts, opts)
    else
      scoped(rt, kind, encode, opts)
    end
  end

  defp scoped(rt, kind, encode, opts) do
    # The gate's route is kept under a key of this call alone, and the gate resolves
    # nothing once the arguments are encoded: a large tensor encoded later in this
    # process inside the scope (a :telemetry handler of this call's events, say) would
    # otherwise resolve a route nobody takes, and a later call would run on it. The key
    # is gone when the call is, however it ends.
    key = {@route, make_ref()}

    gate = fn ->
      case Process.get(key) do
        nil ->
          route = resolve(rt, kind, opts)
          Process.put(key, {:resolved, route})
          slots?(route)

        # (Its arguments are encoded: a tensor encoded now is no argument of this call.)
        _done ->
          false
      end
    end

    try do
      VllmBridge.Shm.scope(gate, fn ->
        encoded = encode.()
        VllmBridge.Shm.Writer.disarm()
        resolved = Process.put(key, :encoded)

        with {:ok, parts} <- encoded do
          case resolved do
            {:resolved, route} -> run(rt, kind, parts, opts ++ [route: route])
            nil -> run(rt, kind, parts, opts)
          end
        end
      end)
    after
      Process.delete(key)
    end
  end

  @doc """
  Whether a request on the route `resolved` (`VllmBridge.Call.Route.resolve/4`'s answer)
  may carry its large tensors in argument slots: a pool of this node whose every worker
  said in its hello that it reads this node's slot directory. Another node's pool,
  session or reference (whose workers cannot read this node's files), a route refused,
  or a pool with a worker that reads no directory (or is starting): false, and the
  tensors take the pipe.
  """
  @spec slots?({:ok, Route.t()} | {:remote, node(), atom()} | {:error, Error.t()}) ::
          boolean()
  def slots?({:ok, %Route{meta: meta}}), do: VllmBridge.Shm.Readers.pool_reads?(meta)
  def slots?(_resolved), do: false

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
    case Directory.pool(rt.pool_name) do
      {:ok, meta} -> lean(rt, parts, what, p, meta)
      _ -> general(rt, "call", parts, what: what, bound: nil, payload: p)
    end
  end

  # (Its route resolved already, by run_encoded/4's gate: a pool of this node, any worker.)
  def plain(%Runtime{session_id: nil} = rt, "call", parts,
        what: what,
        bound: nil,
        payload: p,
        route: {:ok, %Route{meta: meta, constraint: :any, session_id: nil}}
      ),
      do: lean(rt, parts, what, p, meta)

  def plain(rt, kind, parts, opts), do: general(rt, kind, parts, opts)

  # The general path, when it runs, takes the route the lean one had (Route.resolve/4's
  # answer for such a call: the pool, any worker), so that it is resolved once.
  defp lean(rt, parts, what, p, meta) do
    req = Request.new("call", [<<0xC0>>], parts, true, what)

    with true <- Slots.waiting(meta) == 0 and Request.max_size(req) <= meta.max_frame_bytes,
         i when is_integer(i) <- Slots.reserve_any(meta) do
      case Directory.worker_pid(meta.name, i) do
        pid when is_pid(pid) ->
          case reads_slots(meta, i, "call") do
            :ok ->
              pid
              |> Request.call(req, rt.deadline, holds_slot: true)
              |> adopt_loose(%Route{meta: meta, constraint: :any})
              |> named("call", what, rt)

            refused ->
              refused
          end

        nil ->
          # (Route.checkout/3's answer for a worker gone between reserve and look-up.)
          Slots.release(meta, i)
          named(Route.worker_gone(meta, i), "call", what, rt)
      end
    else
      _ ->
        route = {:ok, %Route{meta: meta, constraint: :any}}
        general(rt, "call", parts, what: what, bound: nil, payload: p, route: route)
    end
  end

  @doc false
  # The general path alone (for the lean path's test): any request, any route.
  @spec general(Runtime.t(), String.t(), [iodata()], opts()) ::
          {:ok, term()} | {:error, Error.t()}
  def general(rt, kind, parts, opts) do
    what = Keyword.fetch!(opts, :what)

    result =
      with {:ok, route} <- resolve(rt, kind, opts),
           req = request(kind, route, parts, what, opts),
           {:ok, pid, index} <- Route.checkout(route, req, rt.deadline),
           :ok <- reads_slots(route.meta, index, kind) do
        exchange(pid, req, kind, route, rt)
      end

    case result do
      # Another node's pool, session or reference: the request runs there (its result,
      # a timeout included, is named there).
      {:remote, node, lost} -> remote(node, rt, kind, parts, opts, lost)
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
        remote(node, rt, kind, parts, opts, lost)

      {:ok, route} ->
        span = CallSpan.start(kind, what, route, rt, t0, system_time)

        try do
          req = request(kind, route, parts, what, opts)
          t1 = System.monotonic_time()

          case Route.checkout(route, req, rt.deadline) do
            {:ok, pid, index} ->
              queue_time = System.monotonic_time() - t1

              {result, reply_bytes} =
                case reads_slots(route.meta, index, kind) do
                  :ok -> exchange_sized(pid, req, kind, route, rt)
                  error -> {error, 0}
                end

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

  # The route given (`route:`, resolved by run_encoded/4's gate), else resolved now.
  defp resolve(rt, kind, opts) do
    case Keyword.fetch(opts, :route) do
      {:ok, route} -> route
      :error -> Route.resolve(rt, kind, Keyword.get(opts, :bound), Keyword.get(opts, :payload))
    end
  end

  # Arguments in this node's slots go only to a worker that reads the directory. The
  # route's pool had only such workers when the gate looked (run_encoded/4), and the
  # request runs on that route; but its worker at `index` may have restarted since
  # without the directory (a python wrapper that drops it on some starts), or the pool
  # stopped and one of the same name started (a worker is looked up by the pool's name):
  # the new worker would refuse the slot's name, so the request is refused here, its
  # reservation given back, before anything is sent.
  defp reads_slots(meta, index, kind) do
    if VllmBridge.Shm.lent?() and not VllmBridge.Shm.Readers.worker_reads?(meta.name, index) do
      Slots.release(meta, index)

      {:error,
       Error.new(
         :worker_exit,
         "#{kind}: its large tensors were written to this node's slots for worker " <>
           "#{index} of pool #{inspect(meta.name)}, which no longer reads the slot " <>
           "directory (it restarted without it, or its pool stopped): call again"
       )}
    else
      :ok
    end
  end

  # Another node routes the request itself: the route resolved here does not travel.
  defp remote(node, rt, kind, parts, opts, lost),
    do: Remote.run(node, rt, kind, parts, Keyword.delete(opts, :route), lost)

  # A request of a session must find it still open when its worker writes it (a release
  # need not: the worker brings no session into being for it).
  defp request(kind, route, parts, what, opts) do
    req = Request.new(kind, [session(route)], parts, Keyword.get(opts, :timed, true), what)
    if kind == "release", do: req, else: %{req | session: Route.must_be_open(route)}
  end

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
