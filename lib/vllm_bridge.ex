defmodule VllmBridge do
  @moduledoc """
  The public entry of the bridge: call Python functions, read attributes, stream
  generators and use context managers in a pool of Python worker processes.

      iex> {:ok, _pid} = VllmBridge.start_pool(:example, size: 1)
      iex> VllmBridge.call({"vllm_bridge.forward_context", "is_forward_context_available"},
      ...>   [], %{}, pool_name: :example)
      {:ok, false}
      iex> VllmBridge.stop_pool(:example)
      :ok

  A call that names no `pool_name` goes to the pool `:default` (the examples of the
  functions below run with one started).

  **Targets** are `{"module", "path"}` (a dotted attribute path inside an allow-listed
  module: a function, a class, `"DPMetadata.make"`, a module attribute) or
  `{%VllmBridge.Ref{}, "path" | nil}` (an attribute or method of an object held by a
  worker; `nil` for the object itself).

  **Runtime options** (the last argument, `__runtime__:` in the generated bindings):
  `timeout`, `timeout_profile`, `stream_timeout`, `session_id`, `pool_name`, `affinity`;
  see `VllmBridge.Runtime`. The deadline is fixed when the call enters and covers time
  spent queued.

  **Timeouts cancel in place.** A call past its deadline returns `{:error, %Error{type:
  :timeout}}` and is cancelled in its worker: dropped if it is still queued, interrupted
  where it is if it runs (a Python loop at its next bytecode, a sleep, lock wait or read
  at once, as Ctrl-C would; code in C once it returns to Python). The worker, its
  sessions and their state stay, and the session's next call runs at once. A call that
  has not stopped `cancel_grace` ms (a pool option, 5 000 by default) after its cancel is
  stuck (in C code, in an `__enter__`, or it caught the interruption and went on): its
  worker's Python process is killed and restarted, and every call and session that loses
  it says why (`:worker_exit`, `:session_lost`). Like Ctrl-C, an interruption can leave the
  interrupted code's own state half-updated if it lands in that code's cleanup.

  **Results** are what `VllmBridge.Codec` decodes: plain values, structs for registered
  dataclasses, atoms for enum members, `%VllmBridge.Tensor{}`, `%VllmBridge.Ref{}` for
  objects that cannot travel by value. Every function returns `{:ok, value}` or
  `{:error, %VllmBridge.Error{}}` (see `VllmBridge.Error` for the types); nothing here
  raises on a bad argument.

  **References** belong to an owner, and are released when it goes: those made in a
  session to the session (released when it closes or its owner process exits), those
  made outside any session to the process that made the call or read the stream
  (released when that process exits, so a `Task` that returns one hands over a reference
  about to go). `release/2` releases either earlier.

  **Across nodes.** A pool started on another connected BEAM node is used by its name,
  through this same API (distributed Erlang only: the pools join `:pg` groups, requests
  run in a process spawned on the pool's node; see `VllmBridge.Runtime`, "Nodes", and
  `VllmBridge.Pool.nodes/1`). `pool_name:` prefers this node's pool and otherwise goes to
  a node that has one; `node:` pins a node. What holds there:

    * calls, gets, streams, context managers (`enter/4`, `exit/3`, `with_context/5`),
      `release/2` and sessions (`VllmBridge.Session.open/1`, `with_session/2`) work as on
      one node, with the same results and `VllmBridge.Error`s. The reply is decoded on
      the pool's node, so an atom Python returns comes back as an atom only if that
      node knows it (as `String.to_existing_atom/1` decides there);
    * one deadline: the remote request has the milliseconds left when it leaves, and is
      cancelled in its worker at its deadline as a local one; the caller gives the node
      2 s more to answer (the settle of the cancel), then gives up itself, and the
      remote request is cancelled all the same. A caller that dies (or a
      `Task.shutdown/2`) cancels it too;
    * a session, a context handle and a reference carry their node (`node` field) and
      their requests run there; a `node:` naming another node, or a reference of another
      node as an argument of a request that runs on a node, is `:bad_argument` naming
      both (a reference of another node passed to a call on this node is refused by the
      worker: `:session_lost`, its instance is not the worker's). References made
      outside a session belong to the calling process, on the pool's node: released when
      it exits or its node goes;
    * a node that goes down: every request waiting on it answers at once (when the
      connection drops) with `:worker_exit`, or `:session_lost` for a request in a session
      or on a reference, naming the node; its pools leave the routing. A partition that
      drops no connection is seen only when distribution's tick gives up on it
      (`net_ticktime`, 60 s by default); until then a request waits at most its deadline
      plus those 2 s (a stream: its first chunk's). A request given up on does not start
      there late when a stopped node resumes: the process spawned for it runs nothing
      before the caller's go, which is sent only while the caller still waits (the one
      window left, a freeze within one round trip of the start, is in
      docs/DEPLOYMENT.md, "Netsplits");
    * a netsplit that heals (the connection drops, both nodes live on, and it is made
      again): each node saw the other's processes go, so the sessions that processes of
      one node opened on the other, and the references they held there outside a session,
      were closed and released there. They stay lost: a request in such a session or on
      such a reference answers `:session_lost` naming the node (also once connected
      again), and `VllmBridge.Session.close/2` of such a session answers `:ok`. Open a new
      session; the pools of that node are back in the routing as soon as it reconnects;
    * streams keep their flow control: the generator runs at most two windows ahead of
      the reader (one in its worker, one on the way), see `VllmBridge.Stream`;
    * `call_all/5`, `VllmBridge.Pool.names/0`, `workers/1` and `status/2` are about this
      node's pools (ask the other node with `:erpc`); a remote request's telemetry span
      is emitted on the pool's node (when it has `:telemetry` loaded), not the caller's.
  """

  alias VllmBridge.{Error, Pool, Ref, Session}
  alias VllmBridge.Call.{Context, Run, Runtime, Wire}

  @typedoc "What to call: a module attribute path, or an attribute of a referenced object."
  @type target :: {String.t(), String.t()} | {Ref.t(), String.t() | nil}

  @typedoc "A result of the bridge."
  @type result(t) :: {:ok, t} | {:error, Error.t()}

  # -- pools ------------------------------------------------------------------------------

  @doc "Starts a pool of workers (see `VllmBridge.Pool` and `VllmBridge.Pool.Options`)."
  @spec start_pool(term(), keyword()) :: result(pid())
  defdelegate start_pool(name, opts \\ []), to: Pool, as: :start

  @doc """
  Stops a pool and every Python process of it: returns once they are gone (each had
  `shutdown_grace` to exit on EOF before it was killed), or, for one still there 1.5 s
  after its SIGKILL (stuck in a driver call), with a warning naming it.
  """
  @spec stop_pool(term()) :: :ok | {:error, Error.t()}
  defdelegate stop_pool(name), to: Pool, as: :stop

  # -- calls ------------------------------------------------------------------------------

  @doc """
  Calls `target(*args, **kwargs)` in a worker. `kwargs` is a map or keyword list with
  string or atom keys.

      iex> VllmBridge.call({"vllm_bridge.forward_context", "is_forward_context_available"})
      {:ok, false}
      iex> {:error, %VllmBridge.Error{type: type}} =
      ...>   VllmBridge.call({"vllm_bridge.forward_context", "no_such_function"})
      iex> type
      :bad_argument
  """
  @spec call(target(), list(), map() | keyword(), VllmBridge.Runtime.opts()) :: result(term())
  def call(target, args \\ [], kwargs \\ %{}, opts \\ []) do
    # Large tensors in the arguments may go through shared memory while the call runs
    # (VllmBridge.Shm), when its route is a worker of this node that reads the slot
    # directory (Run.run_encoded/4: the route is resolved once, and the call runs on the
    # route its tensors were encoded for): their slots are given back when it returns.
    with {:ok, rt} <- Runtime.resolve(opts) do
      Run.run_encoded(rt, "call", fn -> Wire.encode_invoke(target, args, kwargs) end,
        what: target,
        bound: Run.bound_ref(target),
        payload: {args, kwargs}
      )
    end
  end

  @doc """
  Calls `target(*args, **kwargs)` once on every worker of `pool`, all at the same time:
  `{:ok, results}`, one per worker in worker index order, when every call succeeds.
  Setting something up in each worker of a running pool, say (for what each worker must
  have from its start, and again after a restart, see the pool option `on_start:`).

      iex> VllmBridge.call_all(:default, {"vllm_bridge.bridge.diag", "add"}, [1, 2])
      {:ok, [3]}

  Otherwise `{:error, %VllmBridge.Error{}}`: its message names each worker that failed
  and why, its `type` (and `python_type`, `traceback`) are the first failure's, and
  `details.results` holds every worker's `{:ok, value}` or `{:error, error}` in index
  order, so nothing that succeeded is lost. A worker that is restarting when the call
  comes, or goes down during it, has its error as its entry (`:worker_exit`).

  `target` is a module target `{"module", "function"}`. `opts` are the runtime options
  of every one of the calls (one `timeout` for all); a `pool_name:` other than `pool` and
  a `session_id:` are `:bad_argument` (a session lives on one worker), and the process's
  current session is not used. References in the results belong to the calling process.
  """
  @spec call_all(term(), target(), list(), map() | keyword(), VllmBridge.Runtime.opts()) ::
          result([term()])
  def call_all(pool, target, args \\ [], kwargs \\ %{}, opts \\ []),
    do: VllmBridge.Call.All.run(pool, target, args, kwargs, opts)

  @doc """
  Reads an attribute: a module attribute, a class attribute, or one of a referenced object.

      iex> VllmBridge.get({"vllm_bridge.forward_context", "track_batchsize"})
      {:ok, false}
  """
  @spec get(target(), VllmBridge.Runtime.opts()) :: result(term())
  def get(target, opts \\ []) do
    with {:ok, rt} <- Runtime.resolve(opts),
         {:ok, parts} <- Wire.encode_invoke(target, nil, nil) do
      Run.run(rt, "get", parts, what: target, bound: Run.bound_ref(target))
    end
  end

  @doc """
  Streams what `target(*args, **kwargs)` yields: `{:ok, enumerable}` whose elements are
  the chunks, or `{:error, %VllmBridge.Error{}}` at once for bad arguments or when the
  application is not started. The request is sent when enumeration begins; halting early
  cancels the generator; errors during enumeration raise `VllmBridge.Error`. See `VllmBridge.Stream`
  (`timeout` bounds the wait for each chunk, `stream_timeout` the whole stream).
  """
  @spec stream(target(), list(), map() | keyword(), VllmBridge.Runtime.opts()) ::
          result(Enumerable.t())
  def stream(target, args \\ [], kwargs \\ %{}, opts \\ []),
    do: VllmBridge.Stream.new(target, args, kwargs, opts)

  # -- context managers -------------------------------------------------------------------

  @doc """
  Calls `target(*args, **kwargs)` and enters the context manager it returns:
  `{:ok, {handle, value}}`, where `value` is what `__enter__` returned and `handle` (a
  `%VllmBridge.Ref{}` of type `"context"`) is what `exit/3` needs. The context belongs to
  a session and is exited when the session closes if not before, so `enter` needs one: a
  `session_id:` in the options or the process's current session
  (`VllmBridge.Session.current/0`); without one it is refused (`:bad_argument`). A target
  `{%Ref{}, nil}` (a context manager held by reference) enters in the reference's session.

  An `enter` that times out leaves nothing entered: `{:error, %Error{type: :timeout}}`,
  and the context is exited again as soon as `__enter__` returns (see
  `VllmBridge.Session`), so later calls of the session do not run inside it. Making the
  context manager (the call of `target`) is interrupted like any call, but `__enter__`
  itself never is (an interruption just after it returned could not be told from one
  inside it, and the context would leak): an `__enter__` still running `cancel_grace` ms
  after the timeout (5 s by default) has its Python process killed, so the worker
  restarts and its sessions are lost (`:session_lost`, saying why).
  """
  @spec enter(target(), list(), map() | keyword(), VllmBridge.Runtime.opts()) ::
          result({Ref.t(), term()})
  def enter(target, args \\ [], kwargs \\ %{}, opts \\ []),
    do: Context.enter(target, args, kwargs, opts)

  @doc """
  Exits a context entered with `enter/4`: `exc` nil for a clean exit, or the error that
  ended its body (a `VllmBridge.Error`, any exception, or a message), which `__exit__`
  receives (the real Python exception when the error came from a call in that session).
  Returns whether `__exit__` suppressed it.

  Once sent, an exit is never cancelled: past the call's deadline the result is
  `{:error, %Error{type: :timeout}}`, but the exit still runs, before any later call of
  the session (a worker runs requests in arrival order). `release/2` likewise.
  """
  @spec exit(Ref.t(), nil | Exception.t() | String.t(), VllmBridge.Runtime.opts()) ::
          result(boolean())
  def exit(handle, exc \\ nil, opts \\ []), do: Context.exit(handle, exc, opts)

  @doc """
  Enters the context manager `target(*args, **kwargs)` returns, runs `fun.(value)` and
  always exits: cleanly when `fun` returns (`{:ok, fun_result}`), with the error when it
  raises, throws or exits (re-raised unless `__exit__` suppressed it, then `{:ok, nil}`).

  It runs in the session of `session_id:` (or the process's current session); without
  one it opens a temporary session (in `pool_name:`) for the enter, the body and the
  exit, and closes it after. While `fun` runs, that session is this process's current
  one, so calls from `fun` that name no `session_id` run in it and see the context:

      iex> cfg = %Vllm.Config.VllmConfig{}
      iex> VllmBridge.with_context({"vllm_bridge.forward_context", "set_forward_context"},
      ...>   [nil, cfg], %{}, [], fn _ ->
      ...>     VllmBridge.call({"vllm_bridge.forward_context", "is_forward_context_available"})
      ...>   end)
      {:ok, {:ok, true}}

  The generated `with_…` bindings use this.
  """
  @spec with_context(
          target(),
          list(),
          map() | keyword(),
          VllmBridge.Runtime.opts(),
          (term() -> result)
        ) ::
          {:ok, result | nil} | {:error, Error.t()}
        when result: term()
  def with_context(target, args, kwargs, opts, fun),
    do: Context.with_context(target, args, kwargs, opts, fun)

  # -- references and sessions ------------------------------------------------------------

  @doc """
  Releases references (one or a list) in the workers that hold them; the number released.
  Without it a reference lives as long as its owner: its session, or, made outside any
  session, the process that made the call (see **References** above). Released refs of
  that process are forgotten, so nothing is released twice.
  """
  @spec release(Ref.t() | [Ref.t()], VllmBridge.Runtime.opts()) :: result(non_neg_integer())
  def release(refs, opts \\ []), do: VllmBridge.Call.Release.run(refs, opts)

  @doc """
  Opens a session (`VllmBridge.Session.open/1` options), runs `fun.(session)` and always
  closes the session; returns what `fun` returns (or the error of opening). While `fun`
  runs the session is this process's current one (`VllmBridge.Session.current/0`): calls
  from `fun` that name no `session_id` (and no other pool) run in it. Tasks started in
  `fun` do not inherit it: pass them `session_id: session.id`.

      iex> fc = "vllm_bridge.forward_context"
      iex> VllmBridge.with_session(fn _session ->
      ...>   {:ok, {handle, _context}} =
      ...>     VllmBridge.enter({fc, "set_forward_context"}, [nil, %Vllm.Config.VllmConfig{}])
      ...>   {:ok, true} = VllmBridge.call({fc, "is_forward_context_available"})
      ...>   {:ok, false} = VllmBridge.exit(handle)
      ...>   VllmBridge.call({fc, "is_forward_context_available"})
      ...> end)
      {:ok, false}
  """
  @spec with_session((Session.t() -> result), keyword()) :: result | {:error, Error.t()}
        when result: term()
  def with_session(fun, opts \\ []), do: Context.with_session(fun, opts)
end
