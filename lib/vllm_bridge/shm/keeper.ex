defmodule VllmBridge.Shm.Keeper do
  @moduledoc false
  # The node's slot directory (VllmBridge.Shm) and the port that removes it when the BEAM
  # dies, owned by a process that does nothing else: the bookkeeping process
  # (VllmBridge.Shm) may crash and restart without taking the directory with it, so
  # workers that were given its path keep reading the same directory. It also owns the
  # table of which caller each lent argument slot is lent to (VllmBridge.Shm.Lent, written
  # by the bookkeeper), so that a restarted bookkeeper lends them to the same callers.
  #
  # The directory is `<root>/vllm_bridge-<os pid>-<random>` (mode 0700; root: `config
  # :vllm_bridge, shm_dir:`, default "/dev/shm", false: none). The keeper port runs
  # `/bin/sh -c 'cat >/dev/null; rm -rf -- "$0"' DIR`: when this process or the BEAM dies
  # by any means (kill -9 included) its stdin reaches EOF and it removes the directory.
  # Should this process ever restart, the directory is a new one, and the bookkeeper
  # restarts after it (VllmBridge.Shm's supervisor is rest_for_one); workers started
  # before then no longer read it, and their pools' tensors take the pipe until they
  # restart (their hellos, VllmBridge.Shm.reads?/1).

  use GenServer

  require Logger

  @default_min_bytes 1024 * 1024
  @key {VllmBridge.Shm, :dir}

  @doc false
  def start_link(opts), do: GenServer.start_link(__MODULE__, opts, name: __MODULE__)

  @impl true
  def init(opts) do
    Process.flag(:trap_exit, true)
    root = Keyword.get(opts, :root, Application.get_env(:vllm_bridge, :shm_dir, "/dev/shm"))

    min =
      Keyword.get(opts, :min_bytes, Application.get_env(:vllm_bridge, :shm_min_bytes)) ||
        @default_min_bytes

    case make_dir(root) do
      {:ok, path, uid, ino} ->
        port =
          Port.open({:spawn_executable, "/bin/sh"}, [
            {:args, ["-c", ~S(cat >/dev/null; rm -rf -- "$0"), path]},
            :binary
          ])

        # backoff: [until when (monotonic ms) large tensors take the pipe, the file system
        # being full; whether that was logged] (VllmBridge.Shm.put/1).
        dir = %{path: path, ino: ino, uid: uid, min_bytes: min, backoff: :atomics.new(2, [])}
        # Which caller each lent argument slot is lent to, written by the bookkeeper
        # (VllmBridge.Shm), here so that it outlives a crash of that process.
        _ = :ets.new(VllmBridge.Shm.Lent, [:named_table, :public, :set])
        :persistent_term.put(@key, dir)
        {:ok, %{path: path, port: port}}

      {:error, why} ->
        Logger.debug("vllm_bridge: no shared memory for tensors (#{why}); they take the pipe")
        :persistent_term.put(@key, :disabled)
        {:ok, %{path: nil, port: nil}}
    end
  end

  @doc false
  # Makes `<root>/vllm_bridge-<os pid>-<random>`, mode 0700: `{:ok, path, uid, inode}` or
  # `{:error, why}` (no root, not a writable directory).
  @spec make_dir(term()) ::
          {:ok, String.t(), non_neg_integer(), non_neg_integer()} | {:error, String.t()}
  def make_dir(root) when root in [nil, false], do: {:error, "shm_dir is off"}
  # (As `-vllm_bridge shm_dir "..."` on erl's command line gives it.)
  def make_dir([c | _] = root) when is_integer(c), do: make_dir(List.to_string(root))

  def make_dir(root) when is_binary(root) do
    name = "vllm_bridge-#{System.pid()}-#{Base.encode16(:rand.bytes(6), case: :lower)}"
    path = Path.join(root, name)

    with :ok <- :file.make_dir(path) |> why("cannot make #{path}"),
         :ok <- :file.change_mode(path, 0o700) |> why("cannot chmod #{path}"),
         {:ok, %File.Stat{uid: uid, inode: ino}} <- File.lstat(path) |> why("cannot stat #{path}") do
      {:ok, path, uid, ino}
    end
  end

  def make_dir(root), do: {:error, "shm_dir must be a path or false, got #{inspect(root)}"}

  defp why(:ok, _), do: :ok
  defp why({:ok, _} = ok, _), do: ok
  defp why({:error, reason}, what), do: {:error, "#{what}: #{reason}"}

  @impl true
  def handle_info({port, _}, %{port: port} = state), do: {:noreply, state}

  # The keeper's shell gone (killed by someone): nothing will remove the directory after a
  # kill -9 of the BEAM any more (a normal stop still does, in terminate/2). Said once;
  # not restarted, because the running workers read this directory by its path and a new
  # keeper would make a new one.
  def handle_info({:EXIT, port, reason}, %{port: port, path: path} = state) do
    require Logger

    Logger.warning(
      "vllm_bridge: the keeper of the slot directory #{path} exited (#{inspect(reason)}); " <>
        "if this BEAM is killed, remove that directory by hand"
    )

    {:noreply, %{state | port: nil}}
  end

  def handle_info({:EXIT, _, _}, state), do: {:noreply, state}

  @impl true
  def terminate(_reason, %{path: path}) do
    :persistent_term.put(@key, :disabled)
    if path, do: File.rm_rf(path)
    :ok
  end
end
