defmodule VllmBridge.Call.Runtime do
  @moduledoc false
  # The runtime options of one call resolved once, when it enters the bridge: the
  # deadline fixed, the session and pool picked, bad options refused by name. What the
  # options mean is documented for users in VllmBridge.Runtime; resolve/2 has a general
  # path (any config, profiles, messages) and a one-pass path for the common case (no
  # `:runtime` config, plain values), which the runtime options test checks against it.

  alias VllmBridge.Error

  @profiles VllmBridge.Runtime.profiles()
  @keys VllmBridge.Runtime.keys()
  @affinities VllmBridge.Runtime.affinities()

  # The longest finite timeout: what `receive ... after` takes (2^32 - 1 ms, about 49.7
  # days). A larger one raised `:timeout_value` in the caller's receive instead of being
  # refused here, naming it.
  @max_ms 4_294_967_295

  defstruct timeout: 120_000,
            stream_timeout: 1_800_000,
            profile: :default,
            deadline: :infinity,
            session_id: nil,
            pool_name: :default,
            pool_given?: false,
            session_current?: false,
            affinity: :strict_queue,
            node: nil,
            session_node: nil

  @type ms :: VllmBridge.Runtime.ms()

  @typedoc "A resolved call: `deadline` is in `System.monotonic_time(:millisecond)` units."
  @type t :: %__MODULE__{
          timeout: ms(),
          stream_timeout: ms(),
          profile: atom(),
          deadline: integer() | :infinity,
          session_id: String.t() | nil,
          pool_name: term(),
          pool_given?: boolean(),
          session_current?: boolean(),
          affinity: :hint | :strict_queue | :strict_fail_fast,
          node: node() | nil,
          session_node: node() | nil
        }

  @type opts :: VllmBridge.Runtime.opts()

  @doc """
  Resolves `opts` against the application config and fixes the deadline: `kind` `:call`
  uses `timeout`, `:stream` uses `stream_timeout`.
  """
  @spec resolve(opts() | nil, :call | :stream) :: {:ok, t()} | {:error, Error.t()}
  def resolve(opts, kind \\ :call)

  def resolve(nil, kind), do: resolve([], kind)

  # The bit of quick/3's `seen` that says session_id was given (see @quick_bits).
  @session_bit 2

  def resolve(opts, kind) when is_list(opts) do
    # (The erlang functions under System.monotonic_time/1 and Application.get_env/3,
    # without their wrappers' checks: this runs on every call.)
    now = :erlang.monotonic_time(:millisecond)

    with true <- :application.get_env(:vllm_bridge, :runtime) in [:undefined, {:ok, []}],
         {:ok, rt, seen} <- quick(opts, %__MODULE__{}, 0) do
      budget = if kind == :stream, do: rt.stream_timeout, else: rt.timeout
      rt = if Bitwise.band(seen, @session_bit) == 0, do: current_session(rt), else: rt
      {:ok, %{rt | deadline: deadline(now, budget)}}
    else
      _ -> full_resolve(opts, kind, now)
    end
  end

  def resolve(other, _kind),
    do: bad("runtime options must be a keyword list, got #{inspect(other, limit: 8)}")

  # No `:runtime` config: the call's own options over the table's defaults, in one pass.
  # A profile, a key given twice, or a value that needs a message takes the full path.
  @quick_bits %{
    pool_name: 1,
    session_id: @session_bit,
    timeout: 4,
    stream_timeout: 8,
    affinity: 16,
    node: 32
  }

  defp quick([], rt, seen), do: {:ok, rt, seen}

  defp quick([{key, value} | rest], rt, seen) when is_map_key(@quick_bits, key) do
    bit = Map.fetch!(@quick_bits, key)

    with 0 <- Bitwise.band(seen, bit),
         {:ok, rt} <- quick_put(key, value, rt) do
      quick(rest, rt, Bitwise.bor(seen, bit))
    else
      _ -> :slow
    end
  end

  defp quick(_opts, _rt, _seen), do: :slow

  defp quick_put(:pool_name, pool, rt), do: {:ok, %{rt | pool_name: pool, pool_given?: true}}
  defp quick_put(:session_id, nil, rt), do: {:ok, rt}
  defp quick_put(:session_id, id, rt) when is_binary(id), do: {:ok, %{rt | session_id: id}}

  defp quick_put(:session_id, %{__struct__: VllmBridge.Session, id: id} = s, rt)
       when is_binary(id),
       do: {:ok, %{rt | session_id: id, session_node: s.node}}

  defp quick_put(key, ms, rt)
       when key in [:timeout, :stream_timeout] and
              ((is_integer(ms) and ms >= 0 and ms <= @max_ms) or ms == :infinity),
       do: {:ok, Map.put(rt, key, ms)}

  defp quick_put(:affinity, a, rt) when a in @affinities, do: {:ok, %{rt | affinity: a}}
  defp quick_put(:node, n, rt) when n == nil or n == node(), do: {:ok, %{rt | node: n}}
  defp quick_put(_key, _value, _rt), do: :slow

  defp full_resolve(opts, kind, now) do
    with :ok <- check_keyword(opts, {"runtime option", "runtime options"}),
         defaults = Application.get_env(:vllm_bridge, :runtime, []),
         :ok <-
           check_keyword(
             defaults,
             {"config :vllm_bridge, :runtime", "config :vllm_bridge, :runtime"}
           ),
         {:ok, rt} <- build(opts, defaults) do
      budget = if kind == :stream, do: rt.stream_timeout, else: rt.timeout
      rt = if Keyword.has_key?(opts, :session_id), do: rt, else: current_session(rt)
      {:ok, %{rt | deadline: deadline(now, budget)}}
    end
  end

  # A call that names no session_id runs in the process's current session (set while a
  # with_session/with_… function runs; VllmBridge.Session.current/0), unless it names
  # another pool or another node.
  defp current_session(rt) do
    case VllmBridge.Session.current() do
      %{id: id, pool: pool} = s
      when (not rt.pool_given? or rt.pool_name == pool) and
             (rt.node == nil or rt.node == s.node or (s.node == nil and rt.node == node())) ->
        %{rt | session_id: id, session_current?: true}

      _ ->
        rt
    end
  end

  @doc "Milliseconds left until `deadline` (0 once passed), or `:infinity`."
  @spec remaining(integer() | :infinity) :: ms()
  def remaining(:infinity), do: :infinity

  def remaining(deadline) do
    left = deadline - :erlang.monotonic_time(:millisecond)
    if left > 0, do: left, else: 0
  end

  @doc "The deadline `ms` after monotonic time `now`."
  @spec deadline(integer(), ms()) :: integer() | :infinity
  def deadline(_now, :infinity), do: :infinity
  def deadline(now, ms), do: now + ms

  # -- resolution -------------------------------------------------------------------------

  defp build(opts, defaults) do
    with {:ok, profile} <- pick(:timeout_profile, opts, defaults, :default),
         {:ok, {p_timeout, p_stream}} <- profile(profile),
         {:ok, timeout} <- timeout(:timeout, opts, defaults, p_timeout),
         {:ok, stream_timeout} <- timeout(:stream_timeout, opts, defaults, p_stream),
         {:ok, session} <- pick(:session_id, opts, defaults, nil),
         {:ok, session_id} <- session_id(session),
         {:ok, pool} <- pick(:pool_name, opts, defaults, :default),
         {:ok, affinity} <- pick(:affinity, opts, defaults, :strict_queue),
         :ok <- affinity(affinity),
         {:ok, node} <- pick(:node, opts, defaults, nil),
         :ok <- node_name(node) do
      {:ok,
       %__MODULE__{
         timeout: timeout,
         stream_timeout: stream_timeout,
         profile: profile,
         session_id: session_id,
         # A session struct names its node: one this node does not know (it came in a
         # message, say) is routed there (VllmBridge.Call.Route).
         session_node: session_node(session),
         pool_name: pool,
         pool_given?: Keyword.has_key?(opts, :pool_name),
         affinity: affinity,
         node: node
       }}
    end
  end

  defp pick(key, opts, defaults, default) do
    case Keyword.fetch(opts, key) do
      {:ok, v} -> {:ok, v}
      :error -> {:ok, Keyword.get(defaults, key, default)}
    end
  end

  # The call's own value, then the profile the call names, then the configured value,
  # then the (configured or default) profile's.
  defp timeout(key, opts, defaults, from_profile) do
    value =
      cond do
        Keyword.has_key?(opts, key) -> Keyword.fetch!(opts, key)
        Keyword.has_key?(opts, :timeout_profile) -> from_profile
        Keyword.has_key?(defaults, key) -> Keyword.fetch!(defaults, key)
        true -> from_profile
      end

    case value do
      :infinity ->
        {:ok, :infinity}

      ms when is_integer(ms) and ms >= 0 and ms <= @max_ms ->
        {:ok, ms}

      bad ->
        bad(
          "#{key} must be a non-negative integer (ms) of at most #{@max_ms} (about 49 days) " <>
            "or :infinity, got #{inspect(bad)}"
        )
    end
  end

  defp profile(name) do
    case Map.fetch(@profiles, name) do
      {:ok, pair} ->
        {:ok, pair}

      :error ->
        bad(
          "timeout_profile must be one of #{inspect(Map.keys(@profiles))}, got #{inspect(name)}"
        )
    end
  end

  defp session_id(nil), do: {:ok, nil}
  defp session_id(id) when is_binary(id), do: {:ok, id}
  defp session_id(%{__struct__: VllmBridge.Session, id: id}) when is_binary(id), do: {:ok, id}

  defp session_id(other),
    do:
      bad("session_id must be a string or a VllmBridge.Session, got #{inspect(other, limit: 5)}")

  defp session_node(%{__struct__: VllmBridge.Session, node: n}), do: n
  defp session_node(_id), do: nil

  defp affinity(a) when a in @affinities, do: :ok

  defp affinity(other),
    do: bad("affinity must be one of #{inspect(@affinities)}, got #{inspect(other)}")

  # A node name is an atom (what `node()` and `Node.list/0` give); `nil` leaves the
  # node to the routing. Whether the node is connected and has the pool is the route's
  # question (VllmBridge.Remote), answered with the error of a pool not started there.
  defp node_name(nil), do: :ok

  defp node_name(n) when is_atom(n) and n not in [true, false] do
    if String.contains?(Atom.to_string(n), "@"),
      do: :ok,
      else: node_name({:not_a_node, n})
  end

  defp node_name({:not_a_node, n}),
    do:
      bad(
        "node must be a node name of the form name@host (node() for this one) or nil, " <>
          "got #{inspect(n)}"
      )

  defp node_name(other),
    do:
      bad(
        "node must be a node name (an atom such as :\"gpu@host\", node() for this one) " <>
          "or nil, got #{inspect(other, limit: 5)}"
      )

  defp check_keyword([], _where), do: :ok

  defp check_keyword([{key, _} | rest], where) when key in @keys, do: check_keyword(rest, where)

  defp check_keyword([{key, _} | _], {one, _all}) when is_atom(key),
    do: bad("unknown #{one} #{inspect(key)}; known: #{inspect(@keys)}")

  defp check_keyword(other, {_one, all}),
    do: bad("#{all} must be a keyword list, got #{inspect(other, limit: 8)}")

  defp bad(message), do: {:error, Error.new(:bad_argument, message)}
end
