defmodule VllmBridge.Shm.Sweep do
  @moduledoc false
  # VllmBridge.Shm's sweep of its directory (every @sweep_ms there), of the files its
  # bookkeeping does not track: `slots`, the names it tracks.

  # The result slots (`r-<os pid>-<n>`, with or without `.free`) and the argument slots
  # it held (`e-<n>.held-<os pid>`) of a worker process that is gone: killed, or exited
  # before cleaning up; and untracked argument slots handed back.
  @of_worker ~r/\A(?:r-([0-9]{1,10})-[0-9]{1,20}(?:\.free)?|e-[0-9]{1,20}\.held-([0-9]{1,10}))\z/

  @spec files(String.t() | nil, map()) :: :ok
  def files(nil, _slots), do: :ok

  def files(path, slots) do
    case :file.list_dir(path) do
      {:ok, names} ->
        for name <- names,
            groups = Regex.run(@of_worker, "#{name}", capture: :all_but_first),
            groups != nil,
            pid = Enum.find(groups, &(&1 != "")),
            not File.exists?("/proc/#{pid}") do
          :file.delete(Path.join(path, name))
        end

        # Argument slots handed back (.free) that VllmBridge.Shm does not track: one whose
        # call settled while its worker renamed it .held (settle saw neither), or one free
        # or held by a worker when VllmBridge.Shm restarted. Nobody takes them again.
        for name <- names,
            [n] <- [Regex.run(~r/\A(e-[0-9]{1,20})\.free\z/, "#{name}", capture: :all_but_first)],
            not Map.has_key?(slots, n) do
          :file.delete(Path.join(path, name))
        end

        :ok

      {:error, _} ->
        :ok
    end
  end
end
