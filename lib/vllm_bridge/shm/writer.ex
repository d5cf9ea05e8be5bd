defmodule VllmBridge.Shm.Writer do
  @moduledoc false
  # The caller's side of the slots (VllmBridge.Shm; docs/PROTOCOL.md, "Tensors in slots
  # (ext 8)"), run in the calling process: the scope that lends argument slots to a call
  # (its gate, the slots it lent, in the process dictionary), the write of a tensor into
  # an argument slot, and the checks that the reads of result slots
  # (VllmBridge.Codec.SlotExt) share with it: a name swapped for a link between its lstat
  # and its open is caught. Which slot a caller gets, and what becomes of it after the
  # call, is VllmBridge.Shm's (the bookkeeping process).

  require Logger

  alias VllmBridge.Shm

  @backoff_ms 5_000
  @lent {VllmBridge.Shm, :lent}
  @gate {VllmBridge.Shm, :gate}
  @lost {VllmBridge.Shm, :lost}

  @doc false
  # Whether process `pid` (of this node) is in a scope that names slot `name` (or is
  # gone: its monitor settles its slots). For VllmBridge.Shm's sweep of adopted slots.
  @spec scope_names?(pid(), String.t()) :: boolean()
  def scope_names?(pid, name) do
    case Process.info(pid, :dictionary) do
      nil ->
        true

      {:dictionary, d} ->
        case List.keyfind(d, @lent, 0) do
          {_, names} when is_list(names) -> name in names
          {_, {:off, names}} when is_list(names) -> name in names
          _ -> false
        end
    end
  end

  @doc "`VllmBridge.Shm.lent?/0`."
  @spec lent?() :: boolean()
  def lent?, do: match?([_ | _], Process.get(@lent))

  # How many values `plain?/1` looks at before it gives up (and says "not plain").
  @plain_budget 64

  @doc """
  Whether `term` is plain data that cannot lend a slot when encoded: no struct anywhere
  in it (a `VllmBridge.Tensor` is a struct, and so is any value whose encoding could make
  one). Looks at no more than #{@plain_budget} values: a larger term is not called plain
  (its call takes the scope, as every call did before), so the check costs a small call
  little and a large one nothing it would notice.
  """
  @spec plain?(term()) :: boolean()
  def plain?(term)
  # (A call's payload, `{args, kwargs}`: no arguments is the common case of a binding.)
  def plain?({[], kwargs}) when kwargs == %{}, do: true
  def plain?(term), do: plain?([term], @plain_budget)

  defp plain?([], _budget), do: true
  defp plain?(_stack, 0), do: false

  defp plain?([x | stack], n) do
    case x do
      [] -> plain?(stack, n - 1)
      # (`t` may be an improper tail: any term, looked at as one.)
      [h | t] -> plain?([h, t | stack], n - 1)
      %{__struct__: _} -> false
      %{} when map_size(x) < n -> plain?([:maps.to_list(x) | stack], n - 1)
      %{} -> false
      _ when is_tuple(x) and tuple_size(x) < n -> plain?([Tuple.to_list(x) | stack], n - 1)
      _ when is_tuple(x) -> false
      _ -> plain?(stack, n - 1)
    end
  end

  @doc "`VllmBridge.Shm.scope/2`."
  @spec scope((() -> boolean()), (() -> result)) :: result when result: term()
  def scope(gate, fun) do
    cond do
      Shm.dir() == :disabled ->
        fun.()

      Process.get(@lent) != nil ->
        previous = Process.put(@gate, gate)

        try do
          fun.()
        after
          Process.put(@gate, previous)
        end

      true ->
        scoped(gate, fun)
    end
  end

  defp scoped(gate, fun) do
    Process.put(@lent, [])
    Process.put(@gate, gate)

    try do
      fun.()
    after
      Process.delete(@gate)
      # A slot request that met the bookkeeper's death may have been granted a slot whose
      # name never came back (its successor lends it to this process again: `take/1`):
      # the scope's end settles it too, even when the scope lent nothing else.
      lost? = Process.delete(@lost) == true

      case Process.delete(@lent) do
        [] when not lost? -> :ok
        names -> done({:done, self(), names})
      end
    end
  end

  # Between a crash of the bookkeeping process and its successor's start its name is
  # unregistered, and a cast to it would be dropped: a scope that ends then (one whose
  # request met the death ends at once) has its end said by a process of its own, which
  # waits for the successor (up to 5 s) off the caller's path.
  defp done(msg) do
    case Process.whereis(Shm) do
      nil -> spawn(fn -> say_later(msg, 5_000) end)
      pid -> GenServer.cast(pid, msg)
    end

    :ok
  end

  defp say_later(msg, ms) do
    if VllmBridge.Await.until(fn -> Process.whereis(Shm) != nil end, ms, 10),
      do: GenServer.cast(Shm, msg)

    :ok
  end

  # The scope's gate, asked once (its answer kept for the rest of the scope).
  defp allowed? do
    case Process.get(@gate) do
      answer when is_boolean(answer) ->
        answer

      gate when is_function(gate, 0) ->
        answer = gate.() == true
        Process.put(@gate, answer)
        answer

      _ ->
        false
    end
  end

  @doc """
  The current scope lends no more slots (its call's arguments are encoded): a tensor
  encoded later in it (by a `:telemetry` handler of the call, say) takes the pipe, so
  that no binary outlives the call naming a slot the call hands back.
  """
  @spec disarm() :: :ok
  def disarm do
    if Process.get(@gate) != nil, do: Process.put(@gate, false)
    :ok
  end

  @doc "`VllmBridge.Shm.without/1`."
  @spec without((() -> result)) :: result when result: term()
  def without(fun) do
    # (`{:off, names}`: the enclosing scope's names stay readable by `scope_names?/2`.)
    previous = Process.get(@lent)

    case previous do
      {:off, _} -> :ok
      names -> Process.put(@lent, {:off, names})
    end

    try do
      fun.()
    after
      if previous == nil, do: Process.delete(@lent), else: Process.put(@lent, previous)
    end
  end

  @doc "`VllmBridge.Shm.put/1`."
  @spec put(binary()) :: {:ok, String.t()} | :pipe
  def put(data) do
    with lent when is_list(lent) <- Process.get(@lent),
         %{path: path, min_bytes: min} = dir when byte_size(data) >= min <- Shm.dir(),
         false <- backing_off?(dir),
         true <- allowed?(),
         {:ok, name, new?} <- take(byte_size(data)) do
      Process.put(@lent, [name | lent])

      case write(Path.join(path, name), data, new?) do
        :ok ->
          {:ok, name}

        {:error, :enospc} ->
          no_space(dir, name)
          :pipe

        {:error, reason} ->
          Logger.warning("vllm_bridge: writing the slot #{name} failed (#{inspect(reason)})")
          :pipe
      end
    else
      _ -> :pipe
    end
  end

  # A slot from the bookkeeping process. That process may crash and restart (its
  # successor lends the slots it had lent to the same callers again: VllmBridge.Shm): a
  # caller that meets its death sends this tensor through the pipe rather than exit, and
  # marks its scope, whose end then settles a slot granted as the process died. (A
  # timeout, the process alive but stuck, still exits.)
  defp take(size) do
    GenServer.call(Shm, {:take, self(), size})
  catch
    :exit, {reason, _} when reason in [:noproc, :killed, :shutdown, :normal] -> lost()
    :exit, {{:shutdown, _}, _} -> lost()
  end

  defp lost do
    Process.put(@lost, true)
    :pipe
  end

  # A full file system (a small /dev/shm: Docker gives 64 MiB): the tensor takes the
  # pipe, and so does every large tensor for @backoff_ms, said once in the log.
  # (0: never set; monotonic time may be negative, so 0 is no "long ago".)
  defp backing_off?(%{backoff: ref}) do
    case :atomics.get(ref, 1) do
      0 -> false
      until -> until > System.monotonic_time(:millisecond)
    end
  end

  defp backing_off?(_dir), do: false

  defp no_space(%{backoff: ref, path: path}, name) do
    :atomics.put(ref, 1, System.monotonic_time(:millisecond) + @backoff_ms)

    if :atomics.compare_exchange(ref, 2, 0, 1) == :ok do
      Logger.warning(
        "vllm_bridge: no room in #{path} for the slot #{name} (the file system is full): " <>
          "large tensors take the pipe, and slots are tried again every #{@backoff_ms} ms " <>
          "(said once)"
      )
    end
  end

  defp write(path, data, new?) do
    modes = [:read, :write, :raw, :binary] ++ if(new?, do: [:exclusive], else: [])

    # A new slot is made with O_EXCL (a link planted there fails); a reused one must
    # still be a regular file (Erlang's open has no O_NOFOLLOW; only our uid can write
    # in the 0700 directory).
    with {:ok, seen} <- if(new?, do: {:ok, nil}, else: regular(path)),
         :ok <- between_hook(path),
         {:ok, fd} <- :file.open(path, modes) do
      try do
        with {:ok, _} <- if(new?, do: {:ok, nil}, else: same_file(fd, seen)),
             :ok <- room(fd, seen, byte_size(data)),
             :ok <- :file.pwrite(fd, 0, data),
             {:ok, _} <- :file.position(fd, byte_size(data)),
             do: :file.truncate(fd)
      after
        :file.close(fd)
      end
    end
  end

  # The pages first (posix_fallocate), when the slot is to grow: a full file system fails
  # here at once, not after most of the tensor was copied.
  defp room(fd, seen, n) do
    if n > 0 and (seen == nil or seen.size < n), do: :file.allocate(fd, 0, n), else: :ok
  end

  defp regular(path) do
    case File.lstat(path, time: :posix) do
      {:ok, %File.Stat{type: :regular} = seen} -> {:ok, seen}
      {:ok, %File.Stat{type: type}} -> {:error, {:not_a_regular_file, type}}
      {:error, _} = error -> error
    end
  end

  @doc false
  # The stat of the open file `fd` when it is the file `seen` (an lstat of its name just
  # before the open: same device and inode), else `{:error, why}`. Erlang's open has no
  # O_NOFOLLOW: a name swapped for a link (or another file) between the lstat and the
  # open is caught here, before anything is read or written.
  @spec same_file(term(), File.Stat.t()) :: {:ok, File.Stat.t()} | {:error, String.t()}
  def same_file(fd, %File.Stat{major_device: dev, inode: ino}) do
    case :file.read_file_info(fd, time: :posix) do
      {:ok, info} ->
        case File.Stat.from_record(info) do
          %File.Stat{major_device: ^dev, inode: ^ino} = stat -> {:ok, stat}
          _ -> {:error, "was replaced between its lstat and its open (a link?)"}
        end

      {:error, reason} ->
        {:error, "cannot be read (#{reason})"}
    end
  end

  @doc false
  # Runs the test's hook between an lstat and the open (test/runtime/shm_test.exs swaps a
  # name for a link there); nothing when none is set.
  @spec between_hook(String.t()) :: :ok
  def between_hook(path) do
    case Process.get(:vllm_bridge_slot_swap) do
      nil -> :ok
      hook -> _ = hook.(path)
    end

    :ok
  end
end
