defmodule VllmBridge.Shm.Loans do
  @moduledoc false
  # The result slots a worker process (VllmBridge.Worker) passed to callers in frames
  # they may not have decoded yet, so that a caller that dies before decoding its frame
  # (killed with the reply in its mailbox, or dead before it came) has them handed back
  # at once (renamed `<name>.free`, unread, never copied: docs/PROTOCOL.md, "Lifetimes")
  # instead of leaving them lent until the worker reclaims them.
  #
  # Only frames that name result slots are remembered (VllmBridge.Shm.FrameSlots finds
  # them: a small reply pays one BIF call), with the caller they went to: `pid =>
  # {monitor, names}`. The monitor is this table's own (a caller may also be monitored by
  # VllmBridge.Worker.Calls, whose monitors come and go with its calls): its :DOWN hands
  # the caller's names back. Names a caller decoded are forgotten at the worker's sweep
  # (every second) or when the table grows past @prune_at names, by an lstat each: once a
  # name's file is gone (its reader renamed it `.free`) it can never be lent again.
  #
  # Why a hand-back can never free a slot that another frame names: a worker lends each
  # name once (python/vllm_bridge/bridge/protocol/slots.py takes a handed-back slot again
  # under a new name), and one frame goes to one caller, so a name in this table is named
  # by that caller's frame alone. The hand-back is a rename of that name: if the caller
  # decoded the frame, the name is gone (renamed `.free`, and then maybe taken again
  # under another name, or deleted) and the rename fails, touching nothing; if not, the
  # file is still lent to that frame, which nobody can read any more (its caller is dead,
  # and a frame to an alias reaches only the alias's owner: the caller this table holds,
  # the process that sent the request). Requests without a caller (a context's exit, a
  # release, a session's close: replies of a bool or nil; `on_start`, whose reply the
  # worker process decodes itself) are not remembered.

  alias VllmBridge.Shm
  alias VllmBridge.Shm.FrameSlots

  @prune_at 32
  @names_max 16

  defstruct [:prefix, :dir, callers: %{}, count: 0]

  @typedoc """
  `prefix` the worker's slot name prefix (VllmBridge.Shm.FrameSlots); `dir` the slot
  directory's path; `callers` pid => {monitor, names}; `count` the names held.
  """
  @type t :: %__MODULE__{
          prefix: FrameSlots.prefix(),
          dir: String.t(),
          callers: %{optional(pid()) => {reference(), [String.t()]}},
          count: non_neg_integer()
        }

  @doc false
  # The table of a worker whose hello is `hello` (its os pid, `"pid"`), or nil when the
  # worker writes no result slots into this node's directory.
  @spec new(map()) :: t() | nil
  def new(hello) do
    case {Shm.reads?(hello), Shm.dir()} do
      {true, %{path: dir}} -> %__MODULE__{prefix: FrameSlots.prefix(hello["pid"]), dir: dir}
      _ -> nil
    end
  end

  @doc false
  # The result slots of this worker that `frame` names (VllmBridge.Shm.FrameSlots; []
  # for most frames, found at the cost of one BIF call for a small one).
  @spec names(t(), binary()) :: [String.t()]
  def names(t, frame), do: FrameSlots.names(frame, t.prefix)

  @doc false
  # A frame naming `names` (`names/2`) is about to be sent to `caller` (nil: nobody
  # whose death matters, see the moduledoc): they are remembered for it, and it is
  # monitored.
  @spec lend(t(), pid() | nil, [String.t()]) :: t()
  def lend(t, nil, _names), do: t
  # (A real frame names at most a worker's 4 result slots, each once: a frame that names
  # more, or one name many times, is cut to @names_max distinct names.)
  def lend(t, caller, names),
    do: t |> hold(caller, names |> Enum.uniq() |> Enum.take(@names_max)) |> maybe_prune()

  defp hold(t, caller, names) do
    callers =
      case t.callers do
        %{^caller => {mon, held}} -> %{t.callers | caller => {mon, names ++ held}}
        _ -> Map.put(t.callers, caller, {Process.monitor(caller), names})
      end

    %{t | callers: callers, count: t.count + length(names)}
  end

  defp maybe_prune(%__MODULE__{count: count} = t) when count > @prune_at, do: prune(t)
  defp maybe_prune(t), do: t

  @doc false
  # A :DOWN: `{:ok, t}` when `mon` is this table's monitor of `pid` (its names still lent
  # are handed back), `:error` when it is not (VllmBridge.Worker.Calls's, say).
  @spec down(t() | nil, reference(), pid()) :: {:ok, t()} | :error
  def down(nil, _mon, _pid), do: :error

  def down(t, mon, pid) do
    case t.callers do
      %{^pid => {^mon, names}} ->
        for name <- names, do: hand_back(t.dir, name)
        {:ok, %{t | callers: Map.delete(t.callers, pid), count: t.count - length(names)}}

      _ ->
        :error
    end
  end

  # Renamed `.free` if it is still lent (the file of that name exists only while the lend
  # of the frame that named it lasts); otherwise the rename fails and nothing changes.
  defp hand_back(dir, name) do
    path = Path.join(dir, name)
    # (:prim_file, not :file: in this process, not a call to the node's file server,
    # which every caller's slot read also uses.)
    _ = :prim_file.rename(path, path <> ".free")
    :ok
  end

  @doc false
  # The names whose frames were decoded (their file is gone) are forgotten, and the
  # callers left without names are no longer monitored (the worker's sweep).
  @spec prune(t() | nil) :: t() | nil
  def prune(nil), do: nil
  def prune(%__MODULE__{count: 0} = t), do: t

  def prune(t) do
    callers =
      Enum.reduce(t.callers, %{}, fn {pid, {mon, names}}, acc ->
        case Enum.filter(names, &lent?(t.dir, &1)) do
          [] ->
            # (No :flush, a scan of the worker's mailbox: a :DOWN already on its way
            # finds no monitor here and goes to VllmBridge.Worker.Calls, which ignores it.)
            Process.demonitor(mon)
            acc

          left ->
            Map.put(acc, pid, {mon, left})
        end
      end)

    count = Enum.reduce(callers, 0, fn {_pid, {_mon, names}}, n -> n + length(names) end)
    %{t | callers: callers, count: count}
  end

  defp lent?(dir, name),
    do: match?({:ok, _}, :prim_file.read_link_info(Path.join(dir, name)))

  @doc false
  # How many names the table holds (for tests and diagnostics).
  @spec size(t() | nil) :: non_neg_integer()
  def size(nil), do: 0
  def size(t), do: t.count
end
