defmodule VllmBridge.Ref do
  @moduledoc """
  A reference to a Python object that lives in a worker (msgpack ext 6 of
  docs/PROTOCOL.md).

    * `instance` - the worker process's handshake instance (16 hex digits); a reference
      from an earlier process of the same worker is refused with `:session_lost`
    * `id` - the reference's number, unique within that process
    * `session` - the owning session, `nil` for the worker's default session
    * `type` - the object's qualified Python class name (informational)
    * `node` - the BEAM node whose worker holds the object, set when the reference is
      decoded (on that node: `node()` there), so that it names its node wherever it goes
      (a message, a GenServer reply, an `:erpc` result). `nil` (a struct built by hand)
      and `:nonode@nohost` (decoded before this node was made distributed) are read as
      this node. A request bound to it (`{ref, path}`, `exit/3`, `release/2`) runs on that
      node; one that pins another node (`node:`), or a call to another node that carries
      it as an argument, is refused with `:bad_argument` naming both nodes
  """

  @enforce_keys [:instance, :id]
  defstruct [:instance, :id, session: nil, type: "", node: nil]

  @type t :: %__MODULE__{
          instance: String.t(),
          id: integer(),
          session: String.t() | nil,
          type: String.t(),
          node: node() | nil
        }

  @doc "The node the reference's object lives on (`nil` and `:nonode@nohost` read as this node)."
  @spec node_of(t()) :: node()
  def node_of(%__MODULE__{node: n}) when n in [nil, :nonode@nohost], do: node()
  def node_of(%__MODULE__{node: n}), do: n

  @doc """
  Every reference in `term` (lists, maps, tuples, structs; a tensor holds none), in no
  particular order. `session: :none` keeps only those of the worker's default session.
  """
  @spec collect(term(), keyword()) :: [t()]
  def collect(term, opts \\ []) do
    refs = walk(term, [])

    if Keyword.get(opts, :session) == :none,
      do: Enum.filter(refs, &(&1.session == nil)),
      else: refs
  end

  @doc false
  # `refs` each once, grouped by what one `release` request can name: the worker instance
  # and the session holding them (`%{{instance, session} => refs}`), for
  # VllmBridge.Call.Request.cast_release/2 and VllmBridge.Call.Release. A worker refuses
  # whole a release that names another instance's or another session's reference.
  @spec release_groups([t()]) :: %{{String.t(), String.t() | nil} => [t()]}
  def release_groups(refs) do
    refs
    |> Enum.uniq_by(&{&1.instance, &1.id, &1.session})
    |> Enum.group_by(&{&1.instance, &1.session})
  end

  defp walk(%__MODULE__{} = ref, acc), do: [ref | acc]
  defp walk(%VllmBridge.Tensor{}, acc), do: acc
  defp walk(%_{} = struct, acc), do: struct |> Map.from_struct() |> walk(acc)
  defp walk([h | t], acc), do: walk(t, walk(h, acc))

  defp walk(m, acc) when is_map(m),
    do: Enum.reduce(m, acc, fn {k, v}, a -> walk(v, walk(k, a)) end)

  defp walk(t, acc) when is_tuple(t), do: t |> Tuple.to_list() |> walk(acc)
  defp walk(_other, acc), do: acc
end
