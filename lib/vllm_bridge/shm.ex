defmodule VllmBridge.Shm do
  @moduledoc false
  # Shared memory for large tensors (docs/PROTOCOL.md, "Tensors in slots (ext 8)"): the
  # node's slot directory and the slots that carry arguments to the workers. This module
  # is the directory's facts (what workers get; which pools read it is
  # VllmBridge.Shm.Readers') and the process that keeps the books of the argument slots
  # (which are lent, to whom, which are free); the caller's side (the scope of a call,
  # writing a slot) is VllmBridge.Shm.Writer.
  #
  # One directory per BEAM, kept by VllmBridge.Shm.Keeper (which makes it when the
  # application starts and removes it when the BEAM dies by any means), so that this
  # process, the bookkeeping, may crash and restart without the directory changing under
  # the workers that read it. Without a directory (no root, or one that is not writable)
  # every tensor takes the pipe, and nothing else changes.
  #
  # Slots are plain files in that directory, named by their writer: `e-<n>` the
  # argument slots (written by callers, named and lent by this process), `r-<os pid>-<n>`
  # the result slots of the worker of that os pid. A reader that has copied a slot out
  # hands it back by renaming it to `<name>.free`; its writer takes it again by renaming
  # it (`rename` is atomic: there is one winner; an argument slot back to its name, a
  # result slot to a new one, so that a worker lends each name once), so a slot keeps its
  # pages and the next transfer is a memcpy each way (bench/results/shared-memory.md, "Shared memory for
  # large tensors").
  #
  # Lifetimes: an argument slot is lent to the calling process (monitored) while its
  # call runs (`scope/2`, when the call's route is a pool of this node). When the call ends, a slot the worker did not hand back (it
  # never read it: the call was refused, timed out, or its worker died) is deleted, never
  # reused, so a late reader finds it gone rather than someone else's data; the same
  # when the caller dies. Free slots unused for @idle_ms are deleted. Result slots of a
  # worker whose os process is gone are deleted by a sweep every @sweep_ms; those of a
  # frame whose caller died before decoding it are handed back by the worker process
  # that passed it on (VllmBridge.Shm.Loans).

  use GenServer

  # Argument slots at most (lent and free): past it a tensor takes the pipe.
  @max_slots 8
  @idle_ms 2_000
  @sweep_ms 500
  @key {__MODULE__, :dir}
  @lent VllmBridge.Shm.Lent

  @typedoc "The node's slot directory, or :disabled."
  @type dir :: %{
          path: String.t(),
          ino: non_neg_integer(),
          uid: non_neg_integer(),
          min_bytes: pos_integer(),
          backoff: :atomics.atomics_ref()
        }

  @doc false
  # The directory's keeper, then this process (the bookkeeping): rest_for_one, so that a
  # crash here leaves the directory (and the workers that read it) as they are.
  def child_spec(opts) do
    children = [
      {VllmBridge.Shm.Keeper, opts},
      %{id: __MODULE__, start: {__MODULE__, :start_link, [opts]}}
    ]

    %{
      id: __MODULE__,
      type: :supervisor,
      start:
        {Supervisor, :start_link,
         [children, [strategy: :rest_for_one, name: VllmBridge.Shm.Supervisor]]}
    }
  end

  @doc false
  def start_link(opts), do: GenServer.start_link(__MODULE__, opts, name: __MODULE__)

  @doc "The node's slot directory (`t:dir/0`), or `:disabled`."
  @spec dir() :: dir() | :disabled
  def dir, do: :persistent_term.get(@key, :disabled)

  @doc "The environment a worker gets: `VLLM_BRIDGE_SHM_DIR` and its threshold, or none."
  @spec worker_env() :: [{String.t(), String.t()}]
  def worker_env do
    case dir() do
      :disabled ->
        []

      %{path: path, min_bytes: min} ->
        [{"VLLM_BRIDGE_SHM_DIR", path}, {"VLLM_BRIDGE_SHM_MIN_BYTES", Integer.to_string(min)}]
    end
  end

  @doc "The environment variables `worker_env/0` sets (a pool's `worker_env` may not)."
  @spec own_env() :: [String.t()]
  def own_env, do: ["VLLM_BRIDGE_SHM_DIR", "VLLM_BRIDGE_SHM_MIN_BYTES"]

  @doc "Whether a worker's hello says it opened this node's slot directory."
  @spec reads?(map()) :: boolean()
  defdelegate reads?(hello), to: VllmBridge.Shm.Readers

  @doc "The hello's slot directory when it is not this node's: `{:other, what}`, else `:ok`."
  @spec check_hello(map()) :: :ok | {:other, String.t()}
  defdelegate check_hello(hello), to: VllmBridge.Shm.Readers

  @doc "Records whether the worker at `index` of the pool of `meta` reads the directory."
  @spec mark(VllmBridge.Pool.Meta.t(), non_neg_integer(), boolean()) :: :ok
  defdelegate mark(meta, index, reads), to: VllmBridge.Shm.Readers

  @doc "Whether every worker of the pool of `meta` reads the slot directory (`mark/3`)."
  @spec pool_reads?(VllmBridge.Pool.Meta.t()) :: boolean()
  defdelegate pool_reads?(meta), to: VllmBridge.Shm.Readers

  @doc "Whether the worker now at `index` of the pool named `pool` reads the directory."
  @spec worker_reads?(term(), non_neg_integer()) :: boolean()
  defdelegate worker_reads?(pool, index), to: VllmBridge.Shm.Readers

  @doc """
  Whether the current scope has lent argument slots of this node's directory (encoded
  arguments that only a worker of this node can read).
  """
  @spec lent?() :: boolean()
  defdelegate lent?, to: VllmBridge.Shm.Writer

  @doc """
  Runs `fun` with argument slots allowed where `gate` allows them: a tensor of at least
  the threshold that is encoded meanwhile in this process goes into a slot (ext 8) when
  `gate.()` (asked once per scope, at its first such tensor) is true: the request goes to
  a worker of this node that reads this directory (`VllmBridge.Call.Run.slots?/1` of the
  route `VllmBridge.Call.Run.run_encoded/4` resolved, and runs the request on). When
  `fun` returns (or raises), every slot it lent is given back: kept for reuse when the
  worker handed it back, deleted otherwise. A nested scope has its own gate and shares
  the outermost one's slots.
  """
  @spec scope((() -> boolean()), (() -> result)) :: result when result: term()
  defdelegate scope(gate, fun), to: VllmBridge.Shm.Writer

  @doc """
  Runs `fun` with argument slots off: every tensor it encodes takes the pipe (the
  benchmarks' pipe figures; a worker module of one's own that cannot read ext 8).
  """
  @spec without((() -> result)) :: result when result: term()
  defdelegate without(fun), to: VllmBridge.Shm.Writer

  @doc """
  Writes `data` into an argument slot when this process is inside `scope/2` and its gate allows it, the node
  has a directory, `data` is at least the threshold and a slot can be had: `{:ok,
  name}`; else `:pipe` (the caller sends the bytes inline).
  """
  @spec put(binary()) :: {:ok, String.t()} | :pipe
  defdelegate put(data), to: VllmBridge.Shm.Writer

  @doc false
  # (VllmBridge.Shm.Writer.same_file/2: an open file checked against the lstat before it.)
  @spec same_file(term(), File.Stat.t()) :: {:ok, File.Stat.t()} | {:error, String.t()}
  defdelegate same_file(fd, seen), to: VllmBridge.Shm.Writer

  @doc false
  # (VllmBridge.Shm.Writer.between_hook/1: the tests' hook between an lstat and an open.)
  @spec between_hook(String.t()) :: :ok
  defdelegate between_hook(path), to: VllmBridge.Shm.Writer

  # -- the process ------------------------------------------------------------------------

  @impl true
  def init(_opts) do
    Process.flag(:trap_exit, true)

    case dir() do
      %{path: path} ->
        Process.send_after(self(), :sweep, @sweep_ms)
        {:ok, adopt(%{path: path, slots: %{}, owners: %{}})}

      :disabled ->
        {:ok, %{path: nil, slots: %{}, owners: %{}}}
    end
  end

  # Which caller each lent argument slot is lent to is also in VllmBridge.Shm.Keeper's
  # table (@lent), which outlives this process: after a crash and restart, the slots lent
  # before it are lent again to the same callers, monitored again, and settled as any
  # other when their calls end or their callers die (a caller dead meanwhile: at once),
  # or by the sweep once their caller's scope no longer names them (settle_unnamed/1).
  defp adopt(state) do
    Enum.reduce(:ets.tab2list(@lent), state, fn {name, pid}, acc ->
      path = Path.join(acc.path, name)
      # (Its reader may have handed it back, or hold it, already: settled at its end;
      # its size only makes it the first choice for a tensor of the same size.)
      size =
        Enum.find_value([path, path <> ".free" | held(path)], 0, fn p ->
          with {:ok, %File.Stat{size: n}} <- File.stat(p), do: n, else: (_ -> nil)
        end)

      acc = lend(acc, name, pid, size)
      %{acc | slots: Map.update!(acc.slots, name, &Map.put(&1, :adopted, true))}
    end)
  end

  # A new argument slot's name: `e-<n>`, n unique and increasing for this BEAM's life,
  # not this process's (after a crash and restart it lends in the same directory, which
  # may still hold, or have held, the names of the runs before: a name lent twice would
  # let a frame still in a pipe, naming the first slot, read the second one's data).
  defp new_name, do: "e-#{System.unique_integer([:positive, :monotonic])}"

  @doc false
  # (VllmBridge.Shm.Keeper.make_dir/1, for the tests.)
  defdelegate make_dir(root), to: VllmBridge.Shm.Keeper

  @impl true
  def handle_call({:take, _pid, _size}, _from, %{path: nil} = state),
    do: {:reply, :pipe, state}

  def handle_call({:take, pid, size}, _from, state) do
    case take_free(state, size) do
      {:ok, name, state} ->
        {:reply, {:ok, name, false}, lend(state, name, pid, size)}

      :none when map_size(state.slots) < @max_slots ->
        name = new_name()
        {:reply, {:ok, name, true}, lend(state, name, pid, size)}

      :none ->
        {:reply, :pipe, state}
    end
  end

  # A free slot of this size first, else any free one (one a worker held may have been
  # handed back since); taken back by renaming it.
  defp take_free(state, size) do
    state.slots
    |> Enum.filter(fn {_, s} -> s.owner in [nil, :worker] end)
    |> Enum.sort_by(fn {_, s} -> if s.size == size, do: 0, else: 1 end)
    |> Enum.find_value(:none, fn {name, _} ->
      path = Path.join(state.path, name)

      case :file.rename(path <> ".free", path) do
        :ok -> {:ok, name, state}
        {:error, _} -> nil
      end
    end)
  end

  defp lend(state, name, pid, size) do
    owners =
      Map.update(state.owners, pid, {Process.monitor(pid), [name]}, fn {ref, names} ->
        {ref, [name | names]}
      end)

    slot = %{size: size, owner: pid, used: System.monotonic_time(:millisecond)}
    true = :ets.insert(@lent, {name, pid})
    %{state | owners: owners, slots: Map.put(state.slots, name, slot)}
  end

  @impl true
  # (No directory: a Keeper that restarted without one; nothing is tracked.)
  def handle_cast({:done, _pid, _names}, %{path: nil} = state), do: {:noreply, state}

  def handle_cast({:done, pid, names}, state) do
    # The scope's names, and every slot of `pid`'s that this process adopted (one lent as
    # its predecessor died, whose name never reached the caller, included): they are of
    # a scope that ended, as the caller had one at a time. Not the slots this process
    # lent it itself: a scope's end said late (VllmBridge.Shm.Writer, after a restart)
    # may come after the caller's next scope took one.
    ended = names ++ for {name, %{owner: ^pid, adopted: true}} <- state.slots, do: name
    {:noreply, release(state, pid, Enum.uniq(ended))}
  end

  # `names`, lent to `pid`, are no longer (its monitor goes with its last one).
  defp release(state, pid, names) do
    state =
      case Map.fetch(state.owners, pid) do
        {:ok, {ref, lent}} ->
          case lent -- names do
            [] ->
              Process.demonitor(ref, [:flush])
              %{state | owners: Map.delete(state.owners, pid)}

            rest ->
              %{state | owners: Map.put(state.owners, pid, {ref, rest})}
          end

        :error ->
          state
      end

    Enum.reduce(names, state, &settle_done(&1, pid, &2))
  end

  # An adopted slot whose caller lives on but whose scope's end never came (it was
  # unread in the predecessor's mailbox): settled once the caller's scope no longer
  # names it (VllmBridge.Shm.Writer keeps a scope's names in its process dictionary).
  # Only adopted slots, a while after the adoption (a grant the caller has not read yet
  # is not in its scope's names either).
  defp settle_unnamed(state) do
    now = System.monotonic_time(:millisecond)

    for {name, %{owner: pid, adopted: true, used: used}} when is_pid(pid) <- state.slots,
        now - used > @idle_ms,
        not VllmBridge.Shm.Writer.scope_names?(pid, name),
        reduce: state,
        do: (acc -> release(acc, pid, [name]))
  end

  @impl true
  def handle_info({:DOWN, _ref, :process, pid, _}, state) do
    {{_, names}, owners} = Map.pop(state.owners, pid, {nil, []})
    {:noreply, Enum.reduce(names, %{state | owners: owners}, &settle/2)}
  end

  def handle_info(:sweep, state) do
    Process.send_after(self(), :sweep, @sweep_ms)
    state = expire_free(state)
    :ok = VllmBridge.Shm.Sweep.files(state.path, state.slots)
    {:noreply, settle_unnamed(state)}
  end

  def handle_info({:EXIT, _, _}, state), do: {:noreply, state}

  # A lent slot's call is over. Handed back (renamed .free) by its reader: free. Held by
  # the worker (renamed .held-<os pid>: a tensor in Python still maps it): the worker's
  # until it hands it back or dies. Else nobody read it for this call: deleted (a late
  # reader finds it gone, never someone else's data).
  defp settle(name, state) do
    path = Path.join(state.path, name)

    cond do
      not Map.has_key?(state.slots, name) ->
        state

      File.exists?(path <> ".free") ->
        owned(state, name, nil)

      held(path) != [] ->
        owned(state, name, :worker)

      true ->
        drop(state, name)
    end
  end

  # A caller's call is over: the names it was lent. Its own are settled; one this process
  # does not track (a run of it before took it back already; or, after a restart of
  # VllmBridge.Shm.Keeper, one of the directory before) is gone unless a worker holds it
  # (it hands it back, and the sweep deletes it untracked).
  defp settle_done(name, pid, state) do
    case state.slots do
      %{^name => %{owner: ^pid}} ->
        settle(name, state)

      %{^name => _} ->
        state

      _ ->
        path = Path.join(state.path, name)

        if held(path) == [] do
          _ = :file.delete(path)
          _ = :file.delete(path <> ".free")
        end

        state
    end
  end

  # A slot no longer lent to a caller: free (nil) or held by its worker (:worker).
  defp owned(state, name, owner) do
    slot = %{state.slots[name] | owner: owner, used: System.monotonic_time(:millisecond)}
    forget(%{state | slots: Map.put(state.slots, name, slot)}, name)
  end

  defp drop(state, name) do
    path = Path.join(state.path, name)
    _ = :file.delete(path)
    _ = :file.delete(path <> ".free")
    forget(%{state | slots: Map.delete(state.slots, name)}, name)
  end

  defp forget(state, name) do
    true = :ets.delete(@lent, name)
    state
  end

  defp held(path), do: Path.wildcard(path <> ".held-*")

  # Free slots idle for @idle_ms are deleted; a slot a worker held is free again once
  # handed back, and forgotten when its file is gone (its worker died: the sweep).
  defp expire_free(state) do
    now = System.monotonic_time(:millisecond)

    Enum.reduce(state.slots, state, fn
      {name, %{owner: nil, used: used}}, acc when now - used > @idle_ms ->
        drop(acc, name)

      {name, %{owner: :worker}}, acc ->
        path = Path.join(acc.path, name)

        cond do
          File.exists?(path <> ".free") -> owned(acc, name, nil)
          held(path) == [] -> drop(acc, name)
          true -> acc
        end

      _, acc ->
        acc
    end)
  end
end
