defmodule VllmBridge.AwaitTest do
  # VllmBridge.Await.until/3 bounds a poll by the clock, not by a count of sleeps: the
  # grace before a worker's kill (OsProcess.await_gone/2) was 300 sleeps of 10 ms, which
  # a loaded machine stretched from 3 s to 31 s.
  use ExUnit.Case, async: true

  alias VllmBridge.Await

  defp counting(check) do
    counter = :counters.new(1, [])

    done? = fn ->
      :counters.add(counter, 1, 1)
      check.(:counters.get(counter, 1))
    end

    {done?, fn -> :counters.get(counter, 1) end}
  end

  test "a condition that holds is checked once" do
    {done?, checks} = counting(fn _ -> true end)
    assert Await.until(done?, 1_000, 10)
    assert checks.() == 1
  end

  test "a condition that comes to hold is seen" do
    {done?, checks} = counting(&(&1 >= 3))
    assert Await.until(done?, 60_000, 1)
    assert checks.() == 3
  end

  test "a zero wait checks once and answers false" do
    {done?, checks} = counting(fn _ -> false end)
    refute Await.until(done?, 0, 10)
    assert checks.() == 1
  end

  test "slow checks use up the wait: the time they take counts, not only the sleeps" do
    # Each check takes at least 50 ms, so at most 200 / 50 of them fit before the
    # deadline, plus the one at it. A wait that counted only its 10 ms sleeps would make
    # 21 checks (over a second) before it gave up.
    {done?, checks} =
      counting(fn _ ->
        Process.sleep(50)
        false
      end)

    refute Await.until(done?, 200, 10)
    assert checks.() in 1..5
  end
end
