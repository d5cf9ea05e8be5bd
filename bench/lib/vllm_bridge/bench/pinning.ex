defmodule VllmBridge.Bench.Pinning do
  @moduledoc """
  CPU placement for the latency benchmark (Linux, `taskset` from util-linux).

  On a virtual machine, waking a process that sleeps on another, idle vCPU costs tens of
  microseconds (the vCPU must be woken), while one on the same vCPU is woken at once. A
  one-caller round trip crosses processes several times, so its time depends on where
  the scheduler happened to put them, and two runs of the same code can differ 5x. Pinning
  the BEAM (every thread), the Python workers and the raw echo to one CPU removes that
  chance: the full stack and its floor then run in the same placement.
  """

  @typedoc "What `pin/2` changed: `{os_pid, original_mask}` pairs for `restore/1`."
  @type saved :: [{String.t(), String.t()}]

  @doc "Whether pinning can be done here (Linux with `taskset`)."
  @spec available?() :: boolean()
  def available?,
    do: match?({:unix, :linux}, :os.type()) and System.find_executable("taskset") != nil

  @doc """
  Pins every thread of each OS process in `os_pids` to `cpu`; returns what to restore, or
  `{:error, reason}` (nothing is left changed then).
  """
  @spec pin([non_neg_integer() | String.t()], non_neg_integer()) ::
          {:ok, saved()} | {:error, String.t()}
  def pin(os_pids, cpu) when is_integer(cpu) and cpu >= 0 do
    Enum.reduce_while(os_pids, {:ok, []}, fn pid, {:ok, saved} ->
      pid = to_string(pid)

      with {:ok, mask} <- mask(pid),
           :ok <- taskset(["-a", "-p", "-c", Integer.to_string(cpu), pid]) do
        {:cont, {:ok, [{pid, mask} | saved]}}
      else
        {:error, reason} ->
          restore(saved)
          {:halt, {:error, reason}}
      end
    end)
  end

  @doc "Puts back the masks `pin/2` saved (a process that is gone is skipped)."
  @spec restore(saved()) :: :ok
  def restore(saved) do
    Enum.each(saved, fn {pid, mask} -> taskset(["-a", "-p", mask, pid]) end)
  end

  defp mask(pid) do
    case System.cmd("taskset", ["-p", pid], stderr_to_stdout: true) do
      {out, 0} ->
        case Regex.run(~r/affinity mask:\s*([0-9a-fA-F,]+)/, out) do
          [_, mask] -> {:ok, mask}
          nil -> {:error, "taskset -p #{pid} said #{String.trim(out)}"}
        end

      {out, status} ->
        {:error, "taskset -p #{pid} failed (#{status}): #{String.trim(out)}"}
    end
  end

  defp taskset(args) do
    case System.cmd("taskset", args, stderr_to_stdout: true) do
      {_, 0} ->
        :ok

      {out, status} ->
        {:error, "taskset #{Enum.join(args, " ")} failed (#{status}): #{String.trim(out)}"}
    end
  end
end
