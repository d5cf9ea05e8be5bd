defmodule VllmBridge.Shm.Readers do
  @moduledoc false
  # Which workers read the node's slot directory (VllmBridge.Shm; docs/PROTOCOL.md,
  # "Tensors in slots (ext 8)"): a worker's hello says which directory it opened; a
  # pool keeps one flag per worker (its meta's `shm` atomics, set at each hello, 0 while
  # the worker starts); argument slots go only to a pool whose every worker reads it, and
  # a request whose arguments are in slots is sent only to a worker that still does.
  # (VllmBridge.Shm delegates here: its callers name VllmBridge.Shm.)

  alias VllmBridge.Shm

  @doc """
  Whether a worker's hello says it opened this node's slot directory: its `"shm"` names
  the directory's path and inode. A worker started without the directory (a `python:`
  wrapper that drops `VLLM_BRIDGE_SHM_DIR`, another uid, a directory that failed its
  checks, a worker module of one's own) is sent no slot names.
  """
  @spec reads?(map()) :: boolean()
  def reads?(hello) do
    case {Shm.dir(), hello} do
      {%{path: path, ino: ino}, %{"shm" => %{"path" => path, "ino" => ino}}} -> true
      _ -> false
    end
  end

  @doc """
  The hello's slot directory when it is not this node's (`{:other, what}`), else `:ok`: a
  worker that writes its results into another directory would send names this node
  cannot read (its start fails, naming both).
  """
  @spec check_hello(map()) :: :ok | {:other, String.t()}
  def check_hello(%{"shm" => %{} = theirs} = hello) do
    cond do
      reads?(hello) ->
        :ok

      Shm.dir() == :disabled ->
        {:other, "#{inspect(theirs)}, but this node has none"}

      true ->
        {:other,
         "#{inspect(theirs)}, but this node's is #{inspect(Map.take(Shm.dir(), [:path, :ino]))}"}
    end
  end

  def check_hello(_hello), do: :ok

  @doc """
  Records whether the worker at `index` of the pool of `meta` reads the slot directory
  (`reads?/1` of its hello; false while it starts).
  """
  @spec mark(VllmBridge.Pool.Meta.t(), non_neg_integer(), boolean()) :: :ok
  def mark(%{shm: nil}, _index, _reads), do: :ok

  def mark(%{shm: flags}, index, reads),
    do: :atomics.put(flags, index + 1, if(reads, do: 1, else: 0))

  @doc "Whether every worker of the pool of `meta` reads the slot directory (`mark/3`)."
  @spec pool_reads?(VllmBridge.Pool.Meta.t()) :: boolean()
  def pool_reads?(%{shm: nil}), do: false
  def pool_reads?(%{shm: flags, size: size}), do: all_set?(flags, size)

  defp all_set?(_flags, 0), do: true
  defp all_set?(flags, i), do: :atomics.get(flags, i) == 1 and all_set?(flags, i - 1)

  @doc """
  Whether the worker now at `index` of the pool named `pool` reads the slot directory
  (`mark/3`): the check, when a request whose arguments are in slots has its worker,
  that this worker can read them (it, or its pool, may have restarted since the scope's
  gate looked).
  """
  @spec worker_reads?(term(), non_neg_integer()) :: boolean()
  def worker_reads?(pool, index) do
    case VllmBridge.Pool.Directory.pool(pool) do
      {:ok, %{shm: flags, size: size}} when flags != nil and index < size ->
        :atomics.get(flags, index + 1) == 1

      _ ->
        false
    end
  end
end
