defmodule VllmBridge.Call.Route do
  @moduledoc false
  # Where one request goes, decided in the caller's process from its resolved runtime
  # options (`VllmBridge.Call.Runtime`):
  #
  #   * bound to a reference (a target `{%Ref{}, path}`, the handle of `exit`, the refs of
  #     `release`): the worker whose handshake instance the reference carries, whatever the
  #     affinity (`:strict_fail_fast` still fails at once unless it is idle). A reference from a
  #     worker process that is gone is `:session_lost`;
  #   * in a session (`session_id:`): the session's worker, under the affinity of
  #     `VllmBridge.Session`; a session whose worker restarted is `:session_lost`;
  #   * otherwise: any worker of the pool `pool_name:` names.
  #
  # Across nodes (VllmBridge.Remote): a reference or session of another node, a pool this
  # node does not have, or `node:` naming another node answer `{:remote, node, lost}`
  # instead of a route (`lost` the error type should that node go down meanwhile); the
  # request then runs on that node, where this same module routes it locally. A `node:`
  # that differs from the node of the session or reference is `:bad_argument`.
  #
  # `checkout/3` then checks the request against the pool's frame limit (`max_frame_bytes`;
  # a request over it is `:bad_argument`, and nothing is reserved), reserves room
  # (`VllmBridge.Pool.Checkout`) and checks that the worker it got is still the process the
  # session or reference belongs to.

  alias VllmBridge.{Error, Ref, Remote, Session}
  alias VllmBridge.Call.{Request, Runtime, Wire}
  alias VllmBridge.Pool.{Checkout, Directory, Meta, Slots}
  alias VllmBridge.Session.Open

  @enforce_keys [:meta, :constraint]
  defstruct [:meta, :constraint, session_id: nil, expect: nil, session: nil]

  @typedoc """
  `session_id` is the session id sent on the wire; `expect` the instance a
  reference-bound request needs; `session` the open session, when there is one.
  """
  @type t :: %__MODULE__{
          meta: Meta.t(),
          constraint: Checkout.constraint(),
          session_id: String.t() | nil,
          expect: String.t() | nil,
          session: Session.t() | nil
        }

  @doc """
  Decides the route of a request of `kind`; `bound` is the reference it is bound to (or
  nil), `payload` its arguments (looked at only for `:hint`, to see whether they hold
  references).
  """
  @spec resolve(Runtime.t(), String.t(), Ref.t() | nil, term()) ::
          {:ok, t()} | {:remote, node(), :session_lost | :worker_exit} | {:error, Error.t()}
  def resolve(%Runtime{node: pinned} = rt, _kind, %Ref{node: n} = ref, _payload)
      when n not in [nil, :nonode@nohost] and n != node() do
    with :ok <- Remote.same_node(pinned, n, "reference #{ref.id} (#{ref.type})"),
         :ok <- named_session(rt, ref, n) do
      # Its session closed there when the connection to its node dropped.
      case ref.session && Session.Manager.lost_on(ref.session) do
        ^n -> {:error, Session.Remote.lost_with_node(ref.session, n, node())}
        _ -> {:remote, n, :session_lost}
      end
    end
  end

  def resolve(%Runtime{node: pinned}, _kind, %Ref{} = ref, _payload)
      when pinned != nil and pinned != node(),
      do: Remote.same_node(pinned, node(), "reference #{ref.id} (#{ref.type})")

  def resolve(%Runtime{} = rt, _kind, %Ref{} = ref, _payload) do
    case Directory.instance(ref.instance) do
      {pool, index, _pid} ->
        with {:ok, meta} <- pool_meta(pool, lost_ref(ref)),
             :ok <- session_open(ref, index),
             :ok <- named_session(rt, ref, node()) do
          constraint =
            if rt.affinity == :strict_fail_fast, do: {:fail_fast, index}, else: {:only, index}

          {:ok,
           %__MODULE__{
             meta: meta,
             constraint: constraint,
             # (A call naming another session is refused: named_session/3.)
             session_id: ref.session,
             expect: ref.instance
           }}
        end

      nil ->
        {:error, lost_ref(ref)}
    end
  end

  def resolve(%Runtime{session_id: id} = rt, kind, nil, payload) when is_binary(id) do
    with {:ok, s} <- lookup_session(rt),
         :ok <- same_pool(rt, s),
         :local <- session_node(rt, s),
         {:ok, meta} <- pool_meta(s.pool, Session.lost(s)),
         {:ok, _pid} <- Session.home(s) do
      constraint =
        case rt.affinity do
          :strict_queue ->
            {:only, s.worker}

          :strict_fail_fast ->
            {:fail_fast, s.worker}

          :hint ->
            if kind in ["call", "get", "stream"] and not has_ref?(payload),
              do: {:prefer, s.worker},
              else: {:only, s.worker}
        end

      {:ok, %__MODULE__{meta: meta, constraint: constraint, session_id: id, session: s}}
    end
  end

  def resolve(%Runtime{pool_name: pool, node: pinned} = rt, _kind, nil, _payload) do
    case Directory.pool(pool) do
      {:ok, meta} when pinned == nil or pinned == node() ->
        {:ok, %__MODULE__{meta: meta, constraint: :any}}

      _elsewhere ->
        with {:remote, n} <- Remote.pool_route(rt), do: {:remote, n, :worker_exit}
    end
  end

  # A session named for a request on a reference must be the reference's own (the
  # process's current session, not named, does not count). Another is refused here,
  # naming why: unknown, on another node than the reference (`n`), or open beside it.
  # The worker would refuse it too, but only after it made a session of that id on the
  # reference's worker, left there; and the check of what must be open when the request
  # is written (must_be_open/1) is made for the reference's session only.
  defp named_session(%Runtime{session_current?: true}, _ref, _n), do: :ok
  defp named_session(%Runtime{session_id: nil}, _ref, _n), do: :ok
  defp named_session(%Runtime{session_id: id}, %Ref{session: id}, _n), do: :ok

  defp named_session(%Runtime{session_id: id}, ref, n) do
    with {:ok, s} <- Session.lookup(id) do
      case Session.node_of(s) do
        ^n ->
          {:error,
           Error.new(
             :bad_argument,
             "reference #{ref.id} (#{ref.type}) belongs to session #{inspect(ref.session)}, " <>
               "not to session #{inspect(id)}: a request on a reference runs in the " <>
               "reference's own session"
           )}

        other ->
          {:error,
           Error.new(
             :bad_argument,
             "session #{inspect(id)} lives on node #{inspect(other)}, but reference " <>
               "#{ref.id} (#{ref.type}) on node #{inspect(n)}: a request on a reference " <>
               "runs on its node, in a session of that node"
           )}
      end
    end
  end

  # A session this node does not know, given as a struct of another node, is routed
  # there (which answers :session_lost if it does not know it either).
  defp lookup_session(%Runtime{session_id: id, session_node: n, node: pinned}) do
    case Session.lookup(id) do
      {:error, _} = error when n in [nil, :nonode@nohost] ->
        error

      {:error, _} = error when n == node() ->
        error

      {:error, _} ->
        with :ok <- Remote.same_node(pinned, n, "session #{inspect(id)}"),
             do: {:remote, n, :session_lost}

      found ->
        found
    end
  end

  # A session of another node runs there; `node:` may only name the session's node.
  defp session_node(%Runtime{node: pinned}, %Session{} = s) do
    n = Session.node_of(s)

    cond do
      pinned != nil and pinned != n -> Remote.same_node(pinned, n, "session #{inspect(s.id)}")
      n == node() -> :local
      true -> remote_session(s, n)
    end
  end

  # Closed there when the connection to its node dropped, even if it came back.
  defp remote_session(s, n) do
    case Session.Manager.lost_on(s.id) do
      nil -> {:remote, n, :session_lost}
      ^n -> {:error, Session.Remote.lost_with_node(s.id, n, node())}
    end
  end

  @doc """
  Reserves room for `req` on a worker of the route before `deadline`: the worker's pid
  and index. A request whose frame could be larger than the pool's `max_frame_bytes` is
  refused first (`:bad_argument` naming its size and the limit), with nothing reserved.
  """
  @spec checkout(t(), Request.t(), integer() | :infinity) ::
          {:ok, pid(), non_neg_integer()} | {:error, Error.t()}
  def checkout(%__MODULE__{meta: meta} = route, %Request{} = req, deadline) do
    with :ok <- fits(meta, req),
         {:ok, i} <- Checkout.checkout(meta, route.constraint, deadline) do
      case Directory.worker(meta.name, i) do
        {pid, instance} ->
          case verify(route, i, instance) do
            :ok ->
              {:ok, pid, i}

            {:error, e} ->
              Slots.release(meta, i)
              {:error, e}
          end

        nil ->
          Slots.release(meta, i)
          worker_gone(meta, i)
      end
    end
  end

  @doc "The error of a request whose worker `i` went down between its reservation and its look-up."
  @spec worker_gone(Meta.t(), non_neg_integer()) :: {:error, Error.t()}
  def worker_gone(meta, i),
    do: {:error, Error.new(:worker_exit, "worker #{i} of pool #{inspect(meta.name)} went down")}

  defp fits(%Meta{max_frame_bytes: max, name: name}, req) do
    case Request.max_size(req) do
      size when size > max ->
        {:error, Wire.too_large(size, max, "max_frame_bytes of pool #{inspect(name)}")}

      _ ->
        :ok
    end
  end

  defp verify(%{expect: expect}, _i, instance) when is_binary(expect) and expect != instance,
    do: {:error, Error.new(:session_lost, "the worker of instance #{expect} is gone")}

  defp verify(%{session: %Session{worker: home} = s}, i, instance) do
    cond do
      i == home and instance != s.instance -> {:error, Session.lost(s)}
      i != home -> Open.touched(s, i, instance)
      true -> :ok
    end
  end

  defp verify(_route, _i, _instance), do: :ok

  defp same_pool(%Runtime{pool_given?: true, pool_name: p}, %Session{pool: q}) when p != q do
    {:error,
     Error.new(
       :bad_argument,
       "pool_name #{inspect(p)} differs from the pool #{inspect(q)} of the session"
     )}
  end

  defp same_pool(_rt, _s), do: :ok

  defp pool_meta(pool, lost) do
    case Directory.pool(pool) do
      {:ok, meta} -> {:ok, meta}
      :error -> {:error, lost}
    end
  end

  @doc false
  # What a request routed so must find open when its worker writes it
  # (VllmBridge.Session.Open.still_open?/1; nil: nothing). A request on a reference of a
  # session must find the session that made the reference, not only one of its id (closed
  # and opened again elsewhere while the request waited in the pool's queue).
  @spec must_be_open(t()) :: Open.which() | nil
  def must_be_open(%__MODULE__{session: nil, session_id: id, expect: inst, constraint: {_, i}})
      when is_binary(id) and is_binary(inst),
      do: {:ref, id, inst, i}

  def must_be_open(%__MODULE__{} = route), do: route.session || route.session_id

  # A reference of a closed session was released with it. Refused here, so that the
  # request does not bring the closed session's state back to life in the worker. The
  # session open under its id must be the one that made it: one that ran on the
  # reference's worker process `index` (its home, or a worker a `:hint` call of it ran
  # on). A session closed and opened again under its id elsewhere is another: the
  # request would make a session of that id on the reference's worker that the open
  # one's close never reaches.
  defp session_open(%Ref{session: nil}, _index), do: :ok

  defp session_open(%Ref{session: id, instance: instance} = ref, index) do
    if Open.ref_open?(id, instance, index), do: :ok, else: {:error, ref_closed(ref)}
  end

  defp ref_closed(%Ref{session: id} = ref) do
    Error.new(
      :bad_argument,
      "reference #{ref.id} (#{ref.type}) belongs to session #{inspect(id)}, which is " <>
        "closed: its references were released with it"
    )
  end

  defp lost_ref(%Ref{} = ref) do
    Error.new(
      :session_lost,
      "reference #{ref.id} (#{ref.type}) comes from worker instance #{ref.instance}, " <>
        "which is gone (its worker restarted or its pool stopped)"
    )
  end

  @doc "Whether a term holds a `%VllmBridge.Ref{}` anywhere (lists, maps, tuples, structs)."
  @spec has_ref?(term()) :: boolean()
  def has_ref?(term), do: Ref.collect(term) != []
end
