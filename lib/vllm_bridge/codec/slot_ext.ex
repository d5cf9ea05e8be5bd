defmodule VllmBridge.Codec.SlotExt do
  @moduledoc false
  # A tensor in a slot (ext 8 of docs/PROTOCOL.md): ext 3's header (dtype code, ndim,
  # device name, shape), then the slot's name (u8 length, ASCII). The data lies in that
  # file of the node's slot directory (VllmBridge.Shm), not in the frame.
  #
  # A frame names a slot, never a path: a name must be of its writer's fixed pattern
  # (`e-<n>` for arguments, which only the worker reads; `r-<os pid>-<n>` for results,
  # which only this side reads). A result slot is read, handed back or renamed only as
  # part of a reply from its own worker: its name's pid must be the OS pid of the Python
  # process the reply came from (which comes with the reply, `within_reply/3`), else the
  # decode fails naming it and its file is not touched: a worker runs user code, which
  # could otherwise read another worker's result and rename it `.free` under that
  # worker's caller. Without a known worker (nil), no result slot is accepted.
  # The reader takes the name relative to the directory,
  # refuses a symbolic link, and checks a regular file of its own uid whose size is the
  # tensor's; then copies the data out and hands the slot back (renames it `<name>.free`).
  #
  # A reply through slots is bounded as one through the pipe: its frame and the data of
  # its slots together at most the frame limit (`max_frame_bytes`) of the worker it came
  # from, which comes with the reply (`within_reply/3`; VllmBridge.Worker.Messages), else
  # the default frame limit. A slot past it is refused before its file is touched (a sparse file declaring
  # 1 TiB would otherwise be read into a binary of 1 TiB) and handed back unread.

  alias VllmBridge.Codec.{Msgpack, TensorExt}
  alias VllmBridge.Codec.Msgpack.Decoder
  alias VllmBridge.{Shm, Tensor}
  alias VllmBridge.Worker.Launcher

  @type_code 8
  @result_name ~r/\Ar-[0-9]{1,10}-[0-9]{1,20}\z/
  # A result slot is deleted before it is read only when its worker exited (the sweep of
  # VllmBridge.Shm, or the worker itself), or when the worker needed a slot while all
  # were lent and this one had been lent past its reclaim age (30 s unless the worker's
  # VLLM_BRIDGE_SHM_RECLAIM_S says otherwise): both causes are named.
  @gone "is gone (its worker exited, or it was lent past the worker's reclaim age " <>
          "and reclaimed for another result, before it was read)"
  # Set while a frame nobody will read is decoded (unread/1).
  @unread {__MODULE__, :unread}
  # Set while a reply is decoded (within_reply/3): {its limit, bytes so far, the os pid
  # of its worker's Python process or nil}.
  @reply {__MODULE__, :reply}

  @doc "The ext 8 value of a tensor (validated by the caller) whose data is in `slot`."
  @spec encode(Tensor.t(), String.t()) :: iodata()
  def encode(%Tensor{dtype: dtype, shape: shape, device: device}, slot) do
    dev = if device == "cpu", do: "", else: device
    payload = payload(dtype, shape, dev, slot)
    [Msgpack.ext_header(@type_code, byte_size(payload)) | payload]
  end

  @doc false
  # The payload bytes (also for the byte vectors' test).
  @spec payload(Tensor.dtype(), [non_neg_integer()], binary(), String.t()) :: binary()
  def payload(dtype, shape, dev, slot) do
    IO.iodata_to_binary([
      Tensor.code(dtype),
      length(shape),
      byte_size(dev),
      dev,
      for(d <- shape, do: <<d::64>>),
      byte_size(slot),
      slot
    ])
  end

  @doc false
  # `{dtype, shape, device, slot}` of a payload, checked; a malformed one fails the decode.
  @spec parse(binary()) :: {Tensor.dtype(), [non_neg_integer()], String.t(), binary()}
  def parse(<<code, ndim, len, dev::binary-size(len), rest::binary>> = payload) do
    dtype =
      case Tensor.from_code(code) do
        {:ok, dtype} -> dtype
        :error -> Decoder.fail!("unknown tensor dtype code #{code}")
      end

    shape_bytes = 8 * ndim

    case rest do
      <<shape_bin::binary-size(shape_bytes), n, slot::binary-size(n)>> ->
        {dtype, for(<<d::64 <- shape_bin>>, do: d), TensorExt.device(dev), slot}

      _ ->
        Decoder.fail!("malformed tensor-in-a-slot (ext 8) payload of #{byte_size(payload)} bytes")
    end
  end

  def parse(payload),
    do: Decoder.fail!("truncated tensor-in-a-slot (ext 8) payload (#{byte_size(payload)} bytes)")

  @doc false
  # The slot name an ext 8 payload holds (`{:ok, name}`; `:error` when it is cut short or
  # has bytes after the name), the rest unchecked; never raises (for the walks that find
  # a frame's slots without decoding it: VllmBridge.Shm.FrameSlots, VllmBridge.Call.Wire.Refused).
  @spec name(binary()) :: {:ok, binary()} | :error
  def name(<<_code, ndim, len, _dev::binary-size(len), rest::binary>>) do
    shape_bytes = 8 * ndim

    case rest do
      <<_::binary-size(shape_bytes), n, name::binary-size(n)>> -> {:ok, name}
      _ -> :error
    end
  end

  def name(_payload), do: :error

  @typedoc """
  Where a reply comes from, as its worker process sends it with the reply
  (VllmBridge.Worker.Messages): that worker's frame limit (`max_frame_bytes`) and the
  OS pid of its Python process, whose result slots (`r-<os pid>-<n>`) alone the reply
  may name. Built once per worker, at its hello.
  """
  @type origin :: {pos_integer(), non_neg_integer()}

  @doc "Decodes an ext 8 payload: reads the slot, hands it back, returns the tensor."
  @spec decode(binary()) :: Tensor.t()
  def decode(payload) do
    {dtype, shape, device, slot} = parse(payload)
    os_pid = owned!(slot)

    if Process.get(@unread),
      do: unread(dtype, shape, device, slot, os_pid),
      else: read_tensor(dtype, shape, device, slot)
  end

  @doc """
  Runs `fun` (a decode of a frame nobody will read) with result slots handed back
  unread: each ext 8 renames its slot `.free` and decodes as a tensor with no data.
  """
  @spec unread((() -> result)) :: result when result: term()
  def unread(fun) do
    previous = Process.put(@unread, true)

    try do
      fun.()
    after
      if previous, do: :ok, else: Process.delete(@unread)
    end
  end

  @doc """
  Runs `fun`, the decode of a reply of `size` bytes from the worker of `origin` (its
  frame limit and its Python process's OS pid; nil: unknown), with its result slots
  bounded as the reply would be through the pipe: the frame and the data of its slots
  together at most that limit (nil: the default one). A slot past the limit fails the
  decode, naming its size and the limit, and is handed back unread. A slot that is not
  that worker's (another pid's; any, when `origin` is nil) fails the decode, naming it,
  and is neither read nor handed back.
  """
  @spec within_reply(origin() | nil, non_neg_integer(), (() -> result)) :: result
        when result: term()
  def within_reply(origin, size, fun) do
    entry =
      case origin do
        {max, os_pid} -> {max, size, os_pid}
        nil -> {Launcher.default_max_frame_bytes(), size, nil}
      end

    previous = Process.put(@reply, entry)

    try do
      fun.()
    after
      if previous, do: Process.put(@reply, previous), else: Process.delete(@reply)
    end
  end

  defp unread(dtype, shape, device, slot, os_pid) do
    hand_back(slot, os_pid)
    %Tensor{dtype: dtype, shape: shape, data: <<>>, device: device}
  end

  @doc false
  # Hands the result slot `slot` back unread (renamed `.free`), when it is a result slot
  # of the worker whose Python process is `os_pid` (own?/2) and still lent; a name handed
  # back already is gone, and nothing changes. Another worker's name is left alone.
  @spec hand_back(binary(), non_neg_integer() | nil) :: :ok
  def hand_back(slot, os_pid) do
    with true <- own?(slot, os_pid),
         %{path: dir} <- Shm.dir() do
      path = Path.join(dir, slot)
      _ = :file.rename(path, path <> ".free")
    end

    :ok
  end

  @doc false
  # Whether `name` is a result slot of the worker whose Python process is `os_pid`:
  # `r-<os_pid>-<n>`, the pid written exactly (no leading zero, not a prefix of another),
  # `n` of 1 to 20 digits. Nobody's (nil) owns none.
  @spec own?(binary(), non_neg_integer() | nil) :: boolean()
  def own?(name, os_pid) when is_integer(os_pid) and is_binary(name),
    do: own_prefix?(name, "r-#{os_pid}-")

  def own?(_name, _os_pid), do: false

  @doc false
  # `own?/2` given the worker's name prefix `r-<os_pid>-` (VllmBridge.Shm.FrameSlots
  # builds it once per worker): the prefix, then 1 to 20 digits.
  @spec own_prefix?(binary(), binary()) :: boolean()
  def own_prefix?(name, prefix) do
    size = byte_size(prefix)

    case name do
      <<^prefix::binary-size(size), n::binary>> when byte_size(n) in 1..20 -> digits?(n)
      _ -> false
    end
  end

  defp digits?(<<c, rest::binary>>) when c in ?0..?9, do: digits?(rest)
  defp digits?(<<>>), do: true
  defp digits?(_), do: false

  # The decode's slot must be its reply's worker's (within_reply/3), checked before its
  # file is touched in any way: that worker's os pid, else the decode fails.
  defp owned!(slot) do
    os_pid =
      case Process.get(@reply) do
        {_limit, _used, os_pid} -> os_pid
        nil -> nil
      end

    cond do
      own?(slot, os_pid) ->
        os_pid

      os_pid == nil ->
        Decoder.fail!(
          "the tensor slot #{inspect(slot)} (ext 8): no worker is known for this reply, " <>
            "so no result slot is accepted; it was not read"
        )

      true ->
        Decoder.fail!(
          "the tensor slot #{inspect(slot)} (ext 8) is not this worker's " <>
            "(os pid #{os_pid}: its result slots are r-#{os_pid}-<n>); it was not read"
        )
    end
  end

  defp read_tensor(dtype, shape, device, slot) do
    nbytes = Enum.reduce(shape, 1, &(&1 * &2)) * Tensor.itemsize(dtype)
    bound(slot, nbytes)

    data =
      case read(Shm.dir(), slot, nbytes) do
        {:ok, data} -> data
        {:error, why} -> Decoder.fail!("the tensor slot #{inspect(slot)} (ext 8): #{why}")
      end

    if dtype == :bool, do: TensorExt.check_bool(data)

    %Tensor{dtype: dtype, shape: shape, data: data, device: device}
  end

  # Within the reply's limit (`within_reply/3`), counted; past it, the slot is handed
  # back unread and the decode fails, before its file is opened or its size looked at.
  defp bound(slot, nbytes) do
    # (Only inside within_reply/3: elsewhere owned!/1 accepts no slot.)
    {limit, used, os_pid} = Process.get(@reply)

    if used + nbytes > limit do
      hand_back(slot, os_pid)

      Decoder.fail!(
        "the tensor slot #{inspect(slot)} (ext 8): its #{nbytes} bytes of data, with the " <>
          "reply's other #{used} bytes, are over the reply limit of #{limit} bytes " <>
          "(max_frame_bytes); it was not read"
      )
    end

    Process.put(@reply, {limit, used + nbytes, os_pid})
    :ok
  end

  @doc false
  # Reads `nbytes` from the result slot `slot` of `dir` and hands it back: `{:ok, data}`
  # or `{:error, why}` (a name of another pattern, a link, not a regular file of our
  # uid, another size, gone).
  @spec read(Shm.dir() | :disabled, binary(), non_neg_integer()) ::
          {:ok, binary()} | {:error, String.t()}
  def read(:disabled, _slot, _nbytes), do: {:error, "this node has no slot directory"}

  def read(%{path: dir, uid: uid}, slot, nbytes) do
    if Regex.match?(@result_name, slot) do
      path = Path.join(dir, slot)

      result =
        with {:ok, %File.Stat{type: :regular} = seen} <- lstat(path),
             :ok <- Shm.between_hook(path),
             {:ok, fd} <- open(path) do
          try do
            with :ok <- check(fd, seen, uid, nbytes), do: pread(fd, nbytes)
          after
            :file.close(fd)
          end
        end

      handed_back(result, path)
    else
      {:error, "not the name of a result slot (r-<os pid>-<n>)"}
    end
  end

  defp lstat(path) do
    case File.lstat(path, time: :posix) do
      {:ok, %File.Stat{type: :regular}} = ok -> ok
      {:ok, %File.Stat{type: type}} -> {:error, "is not a regular file (#{type})"}
      {:error, :enoent} -> {:error, @gone}
      {:error, reason} -> {:error, "cannot be read (#{reason})"}
    end
  end

  defp open(path) do
    case :file.open(path, [:read, :raw, :binary]) do
      {:ok, _} = ok -> ok
      {:error, :enoent} -> {:error, @gone}
      {:error, reason} -> {:error, "cannot be opened (#{reason})"}
    end
  end

  # The open file itself: the file that was lstat'ed (a name swapped for a link, or for
  # another file, after the lstat is caught here: the open followed it), a regular file
  # of our uid of the tensor's size.
  defp check(fd, seen, uid, nbytes) do
    case Shm.same_file(fd, seen) do
      {:ok, %File.Stat{type: type, uid: owner, size: size}} ->
        cond do
          type != :regular -> {:error, "is not a regular file (#{type})"}
          owner != uid -> {:error, "belongs to uid #{owner}, not to this node's #{uid}"}
          size != nbytes -> {:error, "holds #{size} bytes, the tensor needs #{nbytes}"}
          true -> :ok
        end

      {:error, why} ->
        {:error, why}
    end
  end

  defp pread(_fd, 0), do: {:ok, <<>>}

  defp pread(fd, nbytes) do
    case :file.pread(fd, 0, nbytes) do
      {:ok, data} when byte_size(data) == nbytes -> {:ok, data}
      {:ok, data} -> {:error, "gave #{byte_size(data)} bytes, the tensor needs #{nbytes}"}
      :eof -> {:error, "is empty, the tensor needs #{nbytes} bytes"}
      {:error, reason} -> {:error, "cannot be read (#{reason})"}
    end
  end

  # Copied out (or refused): the slot goes back to its writer either way, so that a bad
  # slot is not left lent for ever; a writer reuses it only once it holds no frame.
  defp handed_back(result, path) do
    _ = :file.rename(path, path <> ".free")
    result
  end
end
