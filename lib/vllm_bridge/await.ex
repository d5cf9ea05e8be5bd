defmodule VllmBridge.Await do
  @moduledoc false
  # Polling for a condition until a deadline on the monotonic clock. A wait written as
  # "so many sleeps of 10 ms" counts what it asked for, not what passed: on a loaded
  # machine each round (the sleep, the check, the wait for a scheduler) takes several
  # times its nominal length, and a 3 s grace before a kill became 31 s in a stress run
  # of the suite. Every bounded poll of the library goes through `until/3`.

  @doc """
  Checks `done?` until it returns true (true) or `ms` milliseconds of the monotonic clock
  have passed (false), sleeping `every` ms between checks. `done?` is checked at least
  once, and once more at or after the deadline.
  """
  @spec until((() -> boolean()), non_neg_integer(), pos_integer()) :: boolean()
  def until(done?, ms, every) do
    poll(done?, System.monotonic_time(:millisecond) + ms, every)
  end

  defp poll(done?, deadline, every) do
    if done?.() do
      true
    else
      case deadline - System.monotonic_time(:millisecond) do
        left when left <= 0 ->
          false

        left ->
          Process.sleep(min(left, every))
          poll(done?, deadline, every)
      end
    end
  end
end
