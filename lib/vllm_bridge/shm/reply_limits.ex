defmodule VllmBridge.Shm.ReplyLimits do
  @moduledoc false
  # The frame limit (`max_frame_bytes`) of each worker process of this node, by its pid
  # (whether or not its Python worker writes result slots: a frame may name one all the
  # same), so that a reply's result slots are bounded as the reply would be through the
  # pipe (VllmBridge.Codec.SlotExt): a caller decodes its reply itself, and knows the
  # worker process the reply came from, not that worker's limit.
  #
  # A worker process puts its row when its hello comes and deletes it when it
  # terminates. The table is the keeper's (VllmBridge.Shm.Keeper), made with the
  # directory: without a directory there are no slots to bound and no table. A pid
  # without a row (its worker process ended, or a decode that does not say whose reply it
  # is) gets the default frame limit.

  alias VllmBridge.Worker.Launcher

  @table __MODULE__

  @doc false
  # The table, made by the directory's keeper.
  @spec new() :: :ok
  def new do
    _ = :ets.new(@table, [:named_table, :public, :set, read_concurrency: true])
    :ok
  end

  @doc false
  # The worker process `pid` has the frame limit `max` (bytes).
  @spec put(pid(), pos_integer()) :: :ok
  def put(pid, max) do
    _ = :ets.insert(@table, {pid, max})
    :ok
  rescue
    # No table: the directory's keeper is restarting, and no slot will be read from it.
    ArgumentError -> :ok
  end

  @doc false
  # The worker process `pid` has ended.
  @spec delete(pid()) :: :ok
  def delete(pid) do
    _ = :ets.delete(@table, pid)
    :ok
  rescue
    ArgumentError -> :ok
  end

  @doc false
  # The frame limit of the worker process `pid` (nil: unknown), else the default.
  @spec of(pid() | nil) :: pos_integer()
  def of(nil), do: Launcher.default_max_frame_bytes()

  def of(pid) do
    case :ets.lookup(@table, pid) do
      [{_, max}] -> max
      [] -> Launcher.default_max_frame_bytes()
    end
  rescue
    ArgumentError -> Launcher.default_max_frame_bytes()
  end
end
