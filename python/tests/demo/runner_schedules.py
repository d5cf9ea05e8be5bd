"""Seeded multi-step schedules for runner tests: uneven token counts per DP rank.

Each rank has its own requests (ids ``r{rank}-{n}``). A step may start new requests on a
rank (prompts of 1..``max_prompt`` tokens, prefilled in chunks of at most ``chunk``
tokens), decodes 1 token of every request whose prompt is done, and finishes requests
that have produced ``max_new`` tokens. In step 2 rank 1 schedules nothing at all (its
requests wait), so it runs a dummy pass for the others' sake.
"""

import random
from dataclasses import dataclass, field


@dataclass
class RankStep:
    """One rank's part of a step (the arguments of ``runner.execute_model``)."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_requests: dict[str, list[int]] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)


def make_schedule(
    seed: int,
    num_steps: int,
    dp_size: int = 2,
    vocab: int = 512,
    max_prompt: int = 40,
    chunk: int = 24,
    max_new: int = 3,
) -> list[list[RankStep]]:
    """``steps[s][rank]``: what each rank runs in step ``s``."""
    rng = random.Random(seed)
    # per rank: req_id -> [prompt_len, computed, generated]
    running: list[dict[str, list[int]]] = [{} for _ in range(dp_size)]
    counters = [0] * dp_size
    steps: list[list[RankStep]] = []
    for s in range(num_steps):
        row = []
        for rank in range(dp_size):
            step = RankStep()
            for req_id, (plen, done, gen) in list(running[rank].items()):
                if gen >= max_new:
                    step.finished.append(req_id)
                    del running[rank][req_id]
            # Rank 0 starts more and longer requests than rank 1: uneven counts.
            want = rng.randint(0, 2 if rank == 0 else 1) if s else 1 + rank
            if s == 2 and rank == 1:
                row.append(step)  # an idle step: no new request, nothing scheduled
                continue
            for _ in range(want):
                req_id = f"r{rank}-{counters[rank]}"
                counters[rank] += 1
                plen = rng.randint(1, max_prompt if rank == 0 else max_prompt // 3)
                step.new_requests[req_id] = [rng.randrange(vocab) for _ in range(plen)]
                running[rank][req_id] = [plen, 0, 0]
            for req_id, state in running[rank].items():
                plen, done, gen = state
                n = min(chunk, plen - done) if done < plen else 1
                step.num_scheduled_tokens[req_id] = n
                state[1] += n
                if state[1] >= plen:
                    state[2] += 1
            row.append(step)
        steps.append(row)
    return steps


def merge(row: list[RankStep]) -> RankStep:
    """One step of all ranks as one rank would run it."""
    merged = RankStep()
    for step in row:
        merged.num_scheduled_tokens.update(step.num_scheduled_tokens)
        merged.new_requests.update(step.new_requests)
        merged.finished.extend(step.finished)
    return merged
