defmodule VllmBridge.Demo.CheckTest do
  @moduledoc "When the demo's DP-equals-one-rank check counts as passed (`make demo` fails otherwise)."
  use ExUnit.Case, async: true

  alias VllmBridge.Demo.Check

  test "passes only with tokens compared, none different and logits within the tolerance" do
    ok = %{compared: 40, mismatches: [], max_abs_diff: 9.5e-7}
    assert Check.passed?(ok)
    refute Check.passed?(%{ok | compared: 0})
    refute Check.passed?(%{ok | mismatches: ["step 2, r0-1: 150 vs 151"]})
    refute Check.passed?(%{ok | max_abs_diff: 1.0e-3})
    assert Check.passed?(%{ok | max_abs_diff: 1.0e-3}, 1.0e-2)
  end
end
