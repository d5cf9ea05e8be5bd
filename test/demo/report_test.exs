defmodule VllmBridge.Demo.ReportTest do
  @moduledoc """
  The demo's row of a step says how the step ran: the agreed mode, how the forward pass
  ran (replay / emulated / eager), a `*` on a mode whose step ran eagerly anyway, and a
  footnote with that rank's reason. Pure formatting: generated step outputs, every
  combination of mode and how each rank ran.
  """
  use ExUnit.Case, async: true

  alias VllmBridge.Demo.Report

  defp output(mode, graph, reason \\ nil) do
    %{
      "num_tokens" => 3,
      "num_tokens_padded" => 4,
      "num_tokens_across_dp" => [4, 4],
      "should_ubatch" => false,
      "ubatch_num_tokens" => nil,
      "cudagraph_mode" => mode,
      "moe_chunks" => 1,
      "forward_ms" => 1.25,
      "req_ids" => ["r0-1"],
      "sampled_token_ids" => [7],
      "skipped" => false,
      "graph" => graph,
      "graph_reason" => reason
    }
  end

  # The row's cells, split on the column gaps (two spaces or more).
  defp cells(row), do: String.split(row, ~r/\s{2,}/)

  test "the header has the mode and the graph columns" do
    [header, rule] = Report.header()
    assert header =~ ~r/cudagraph\s+graph\s+MoE chunks/
    assert String.length(rule) >= String.length(header)
  end

  test "every mode and every way a rank ran: mode, graph cell, star and footnote agree" do
    reasons = %{"eager" => "no graph captured for BatchDescriptor(num_tokens=4)"}

    for mode <- ["NONE", "PIECEWISE", "FULL"],
        g0 <- ["replay", "emulated", "eager"],
        g1 <- ["replay", "emulated", "eager"],
        # A NONE step always runs eagerly.
        mode != "NONE" or (g0 == "eager" and g1 == "eager") do
      outs = [output(mode, g0, reasons[g0]), output(mode, g1, reasons[g1])]
      fallback = mode != "NONE" and "eager" in [g0, g1]
      row = Report.row(3, outs, 2.0)
      [_step, _tokens, _padded, _ubatch, mode_cell, graph_cell | _] = cells(row)

      assert mode_cell == if(fallback, do: mode <> "*", else: mode), row
      assert graph_cell == if(g0 == g1, do: g0, else: "#{g0} / #{g1}"), row

      notes = Report.footnotes([[output("NONE", "eager"), output("NONE", "eager")], outs])
      expected_ranks = for {g, r} <- [{g0, 0}, {g1, 1}], fallback and g == "eager", do: r

      expected =
        case expected_ranks do
          [] -> []
          [r] -> ["  * step 2, rank #{r}: #{reasons["eager"]}"]
          rs -> ["  * step 2, ranks #{Enum.join(rs, ", ")}: #{reasons["eager"]}"]
        end

      assert notes == expected
    end
  end

  test "a skipped step shows '-' for its mode and graph, and gets no footnote" do
    skipped = %{
      output("NONE", "eager")
      | "skipped" => true,
        "req_ids" => [],
        "sampled_token_ids" => []
    }

    [_, _, _, _, mode_cell, graph_cell | _] = cells(Report.row(4, [skipped, skipped], 0.5))
    assert {mode_cell, graph_cell} == {"-", "-"}
    assert Report.footnotes([[skipped, skipped]]) == []
  end
end
