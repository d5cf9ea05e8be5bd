defmodule VllmBridge.Bench.ProcCpu do
  @moduledoc """
  The CPU time OS processes have run, for the benchmarks' CPU-a-call figures (Linux):
  each process's threads' run time from `/proc/<pid>/task/<tid>/schedstat`, in
  nanoseconds (the kernel's own accounting, not the 10 ms ticks of `/proc/<pid>/stat`, so
  that a round of a few thousand calls is measured, not rounded). Read it before and
  after a round and divide the difference by the calls. Start the BEAM with its
  schedulers' busy-waiting off (`+sbwt none +sbwtdcpu none +sbwtdio none`) so that
  spinning is not counted as work.
  """

  @doc """
  The summed run time of the threads of `os_pids` now, in ns (a process or thread that is
  gone counts 0).
  """
  @spec ns([non_neg_integer() | String.t()]) :: non_neg_integer()
  def ns(os_pids) do
    Enum.sum(
      for pid <- os_pids, tid <- tasks(pid) do
        case File.read("/proc/#{pid}/task/#{tid}/schedstat") do
          {:ok, s} -> s |> String.split() |> hd() |> String.to_integer()
          {:error, _} -> 0
        end
      end
    )
  end

  defp tasks(pid) do
    case File.ls("/proc/#{pid}/task") do
      {:ok, tids} -> tids
      {:error, _} -> []
    end
  end
end
