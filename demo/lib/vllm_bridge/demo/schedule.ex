defmodule VllmBridge.Demo.Schedule do
  @moduledoc """
  The demo's scheduler: which tokens each DP rank computes in each step, drawn from a
  seeded random generator (the same seed gives the same schedule).

  Each rank has its own requests (ids `"r<rank>-<n>"`). In a step a rank may start new
  requests, prefills their prompts in chunks of at most `:chunk` tokens, decodes one token
  of every request whose prompt is done, and finishes requests that have produced their
  tokens. The ranks are deliberately uneven: rank 0 gets long prompts, rank 1 short ones,
  and in step 4 rank 1 schedules nothing at all (its requests wait), so it runs a dummy
  pass to keep the other rank company in its collectives.

  A rank's step is the keyword arguments of `vllm_bridge.demo.rank.execute_model`:
  `%{"num_scheduled_tokens" => %{id => n}, "new_requests" => %{id => [token]},
  "finished" => [id]}`.
  """

  @typedoc "One rank's part of a step."
  @type rank_step :: %{String.t() => map() | list()}

  @typedoc "The generator's state."
  @type t :: %__MODULE__{
          rng: :rand.state(),
          ranks: %{non_neg_integer() => %{reqs: map(), counter: non_neg_integer()}},
          step: non_neg_integer(),
          vocab: pos_integer(),
          chunk: pos_integer(),
          idle: {pos_integer(), non_neg_integer()} | nil
        }

  defstruct [:rng, :ranks, :step, :vocab, :chunk, :idle]

  # Per rank: {new requests per step (range), prompt lengths (range)}.
  @profiles %{0 => {0..2, 8..96}, 1 => {0..3, 1..28}}

  @doc """
  A schedule generator for `dp_size` ranks (at most 2 profiles; more ranks reuse rank
  1's). Options: `:seed` (integer, default 0), `:vocab` (default 512), `:chunk` (most
  prompt tokens of one request per step, default 64), `:idle` (`{step, rank}` with
  nothing scheduled, default `{4, 1}`; `nil` for none).
  """
  @spec new(pos_integer(), keyword()) :: t()
  def new(dp_size, opts \\ []) when is_integer(dp_size) and dp_size >= 1 do
    seed = Keyword.get(opts, :seed, 0)

    unless is_integer(seed),
      do: raise(ArgumentError, "seed must be an integer, got #{inspect(seed)}")

    %__MODULE__{
      rng: :rand.seed_s(:exsss, {seed, 1_234, 98_765}),
      ranks: Map.new(0..(dp_size - 1), &{&1, %{reqs: %{}, counter: 0}}),
      step: 0,
      vocab: Keyword.get(opts, :vocab, 512),
      chunk: Keyword.get(opts, :chunk, 64),
      idle: Keyword.get(opts, :idle, {4, 1})
    }
  end

  @doc "The next step: one `t:rank_step/0` per rank (by rank), and the new state."
  @spec next(t()) :: {[rank_step()], t()}
  def next(%__MODULE__{} = s) do
    s = %{s | step: s.step + 1}

    {steps, s} =
      Enum.map_reduce(Enum.sort(Map.keys(s.ranks)), s, fn rank, s -> rank_step(s, rank) end)

    {steps, s}
  end

  @doc "All ranks' parts of a step as one rank would run them (the no-DP reference)."
  @spec merge([rank_step()]) :: rank_step()
  def merge(rank_steps) do
    Enum.reduce(rank_steps, empty(), fn step, acc ->
      %{
        "num_scheduled_tokens" =>
          Map.merge(acc["num_scheduled_tokens"], step["num_scheduled_tokens"]),
        "new_requests" => Map.merge(acc["new_requests"], step["new_requests"]),
        "finished" => acc["finished"] ++ step["finished"]
      }
    end)
  end

  @doc "Tokens a rank's step computes."
  @spec num_tokens(rank_step()) :: non_neg_integer()
  def num_tokens(step), do: step["num_scheduled_tokens"] |> Map.values() |> Enum.sum()

  defp empty, do: %{"num_scheduled_tokens" => %{}, "new_requests" => %{}, "finished" => []}

  defp rank_step(s, rank) do
    %{reqs: reqs} = state = s.ranks[rank]
    {done, live} = Enum.split_with(reqs, fn {_id, r} -> r.gen >= r.max_new end)
    finished = done |> Enum.map(&elem(&1, 0)) |> Enum.sort()
    state = %{state | reqs: Map.new(live)}

    if s.idle == {s.step, rank} do
      step = %{empty() | "finished" => finished}
      {step, put_in(s.ranks[rank], state)}
    else
      {new_requests, state, rng} = start_requests(s, rank, state)
      {scheduled, reqs} = schedule(state.reqs, s.chunk)
      step = %{empty() | "num_scheduled_tokens" => scheduled, "new_requests" => new_requests}
      step = %{step | "finished" => finished}
      {step, %{s | rng: rng, ranks: Map.put(s.ranks, rank, %{state | reqs: reqs})}}
    end
  end

  defp start_requests(s, rank, state) do
    {count_range, len_range} = Map.get(@profiles, rank, @profiles[1])
    {count, rng} = uniform(s.rng, if(s.step == 1, do: 1..2, else: count_range))

    Enum.reduce(List.duplicate(nil, count), {%{}, state, rng}, fn _, {new, state, rng} ->
      id = "r#{rank}-#{state.counter}"
      {len, rng} = uniform(rng, len_range)
      {max_new, rng} = uniform(rng, 2..4)

      {prompt, rng} =
        Enum.map_reduce(1..len, rng, fn _, rng -> uniform(rng, 0..(s.vocab - 1)) end)

      req = %{plen: len, done: 0, gen: 0, max_new: max_new}
      state = %{state | counter: state.counter + 1, reqs: Map.put(state.reqs, id, req)}
      {Map.put(new, id, prompt), state, rng}
    end)
  end

  defp schedule(reqs, chunk) do
    Enum.reduce(reqs, {%{}, reqs}, fn {id, r}, {scheduled, reqs} ->
      n = if r.done < r.plen, do: min(chunk, r.plen - r.done), else: 1
      done = r.done + n
      r = %{r | done: done, gen: if(done >= r.plen, do: r.gen + 1, else: r.gen)}
      {Map.put(scheduled, id, n), Map.put(reqs, id, r)}
    end)
  end

  defp uniform(rng, %Range{first: first, last: last}) do
    {x, rng} = :rand.uniform_s(last - first + 1, rng)
    {first + x - 1, rng}
  end
end
