defmodule VllmBridge.Await do
  @moduledoc false
  # Polling for a condition until a deadline on the monotonic clock. A wait written as
  # "so many sleeps of 10 ms" counts what it asked for, not what passed: on a loaded
  # machine each round (the sleep, the check, the wait for a scheduler) takes several
  # times its nominal length, and a 3 s grace before a kill became 31 s in a stress run
  # of the suite. (`VllmBridge.Pool.await_ready/2` keeps a loop of its own: it also
  # ends early with an error, and is bounded by the same clock.)

  @doc """
  Checks `done?` until it returns true (true) or `ms` milliseconds of the monotonic clock
  have passed (false), sleeping `every` ms (at most what is left) between checks. `done?`
  is checked at least once; a check that ends at or past the deadline is the last.
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
