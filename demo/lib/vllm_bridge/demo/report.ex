defmodule VllmBridge.Demo.Report do
  @moduledoc """
  The demo's printed output: one table row per step, the batch-size statistics, and the
  tokens each request got. Pure formatting (strings in, strings out).

  A step's output (from `vllm_bridge.demo.rank.execute_model`) is a map with string keys:
  `"num_tokens"`, `"num_tokens_padded"`, `"num_tokens_across_dp"`, `"should_ubatch"`,
  `"ubatch_num_tokens"`, `"cudagraph_mode"`, `"moe_chunks"`, `"forward_ms"`, `"req_ids"`,
  `"sampled_token_ids"`, `"skipped"`, `"graph"`, `"graph_reason"`, ...

  Column "cudagraph" is the agreed runtime mode; column "graph" says how the forward pass
  ran: `replay` (CUDA graphs), `emulated` (no CUDA: the captured pieces ran eagerly) or
  `eager`. A mode other than NONE whose step still ran eagerly (its descriptor had no
  graph) is marked with a `*` (`PIECEWISE*`), and `footnotes/1` gives each such step's
  reason after the table.
  """

  @columns [
    {"step", 4},
    {"tokens r0/r1", 12},
    {"padded r0/r1", 12},
    {"micro-batching", 15},
    {"cudagraph", 10},
    {"graph", 8},
    {"MoE chunks", 10},
    {"forward ms r0/r1", 16},
    {"step ms", 7},
    {"sampled (request:token)", 0}
  ]

  @doc "The table's header and rule."
  @spec header() :: [String.t()]
  def header do
    line = Enum.map_join(@columns, "  ", fn {name, width} -> pad(name, width) end)
    [line, String.duplicate("-", String.length(line) + 8)]
  end

  @doc "One step's row: its number, each rank's output, and the step's wall time (ms)."
  @spec row(pos_integer(), [map()], number()) :: String.t()
  def row(index, outputs, wall_ms) do
    first = hd(outputs)

    cells = [
      Integer.to_string(index),
      per_rank(outputs, & &1["num_tokens"]),
      per_rank(outputs, & &1["num_tokens_padded"]),
      ubatch(first),
      mode(outputs),
      graph(outputs),
      Integer.to_string(first["moe_chunks"]),
      per_rank(outputs, &ms(&1["forward_ms"])),
      ms(wall_ms),
      sampled(outputs)
    ]

    @columns
    |> Enum.zip(cells)
    |> Enum.map_join("  ", fn {{_name, width}, cell} -> pad(cell, width) end)
    |> String.trim_trailing()
  end

  @doc """
  The footnotes of the rows marked `*`: for each step (its number, from 1) whose mode was
  not NONE but a rank ran it eagerly, that rank's reason. `steps` are each step's
  outputs, one per rank.
  """
  @spec footnotes([[map()]]) :: [String.t()]
  def footnotes(steps) do
    for {outputs, index} <- Enum.with_index(steps, 1),
        {reason, ranks} <- fallback_reasons(outputs) do
      label = if length(ranks) == 1, do: "rank", else: "ranks"
      "  * step #{index}, #{label} #{Enum.join(ranks, ", ")}: #{reason}"
    end
  end

  # The eager ranks of a step, grouped by their reason (in rank order).
  defp fallback_reasons(outputs) do
    outputs
    |> Enum.with_index()
    |> Enum.filter(fn {out, _} -> eager_fallback?(out) end)
    |> Enum.group_by(fn {out, _} -> out["graph_reason"] || "no reason given" end, &elem(&1, 1))
    |> Enum.sort_by(fn {_, ranks} -> ranks end)
  end

  defp mode([first | _] = outputs) do
    cond do
      first["skipped"] -> "-"
      Enum.any?(outputs, &eager_fallback?/1) -> first["cudagraph_mode"] <> "*"
      true -> first["cudagraph_mode"]
    end
  end

  defp graph([first | _] = outputs) do
    if first["skipped"] do
      "-"
    else
      outputs |> Enum.map(& &1["graph"]) |> Enum.uniq() |> Enum.join(" / ")
    end
  end

  # A step that had a graph mode but ran eagerly: its descriptor had no graph.
  defp eager_fallback?(out) do
    not out["skipped"] and out["graph"] == "eager" and out["cudagraph_mode"] != "NONE"
  end

  defp per_rank(outputs, fun), do: Enum.map_join(outputs, " / ", &to_string(fun.(&1)))

  defp ubatch(%{"should_ubatch" => true, "ubatch_num_tokens" => sizes}),
    do: "yes " <> Enum.join(sizes, "+")

  defp ubatch(_), do: "no"

  defp sampled(outputs) do
    pairs =
      for out <- outputs,
          {req, token} <-
            Enum.sort_by(
              Enum.zip(out["req_ids"], out["sampled_token_ids"]),
              &request_order(elem(&1, 0))
            ),
          do: "#{req}:#{token}"

    {shown, rest} = Enum.split(pairs, 5)
    more = if rest == [], do: "", else: " +#{length(rest)}"
    if pairs == [], do: "-", else: Enum.join(shown, " ") <> more
  end

  @doc """
  The batch-size statistics of each rank, from `forward_context.get_batchsize_stats`:
  `{padded_batch_size, passes, median_ms}` entries, most frequent first.
  """
  @spec stats([[{integer() | nil, integer(), number()}]]) :: [String.t()]
  def stats(per_rank) do
    per_rank
    |> Enum.with_index()
    |> Enum.map(fn {entries, rank} ->
      body =
        Enum.map_join(entries, ", ", fn {size, count, median} ->
          "#{size} tokens x#{count} (#{ms(median)} ms)"
        end)

      "  rank #{rank}: " <> if(body == "", do: "(none)", else: body)
    end)
  end

  @doc "Each request's sampled tokens, in the order they came: `r0-1: 17 prompt -> 5 9`."
  @spec requests(%{String.t() => [integer()]}, %{String.t() => pos_integer()}) :: [String.t()]
  def requests(tokens, prompt_lens) do
    tokens
    |> Enum.sort_by(fn {req, _} -> request_order(req) end)
    |> Enum.map(fn {req, toks} ->
      "  #{pad(req, 6)} #{pad("#{prompt_lens[req]}-token prompt", 16)} -> " <>
        Enum.join(toks, " ")
    end)
  end

  defp request_order(req) do
    case Regex.run(~r/^r(\d+)-(\d+)$/, req) do
      [_, rank, n] -> {String.to_integer(rank), String.to_integer(n)}
      _ -> {1_000_000, req}
    end
  end

  @doc "Milliseconds with one decimal."
  @spec ms(number()) :: String.t()
  def ms(value), do: :erlang.float_to_binary(value / 1, decimals: 1)

  defp pad(text, width), do: String.pad_trailing(text, width)
end
