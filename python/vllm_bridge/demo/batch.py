"""Request state and input preparation of the model runner (see :mod:`vllm_bridge.demo.rank`).

A *step* is what a scheduler hands the runner (vLLM's ``SchedulerOutput``, reduced): how
many tokens of each request to compute now, the prompts of requests that are new, and the
requests that are finished. A request's tokens are its prompt followed by the tokens
sampled for it; each step computes the next ``n`` of them. When a step computes a
request's last known token, the runner samples the next one (greedy), so the following
step can schedule it (a decode step schedules 1 token).

Each request owns one region of ``max_model_len`` KV-cache slots; its token at position
``p`` is kept in slot ``region * max_model_len + p``.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from vllm_bridge._checks import check_int
from vllm_bridge.demo.model.layers import AttentionMetadata

__all__ = ["InputBatch", "RequestState", "SchedulerStep", "prepare_inputs"]


@dataclass
class SchedulerStep:
    """One step's schedule.

    Attributes:
        num_scheduled_tokens: Tokens to compute now, by request id (0 entries are skipped).
        new_requests: Prompt token ids of the requests that start in this step.
        finished: Requests to forget before this step (their KV regions are freed).
    """

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_requests: dict[str, list[int]] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.num_scheduled_tokens, Mapping):
            raise TypeError(
                f"num_scheduled_tokens must be a dict of request id -> int, "
                f"got {self.num_scheduled_tokens!r}"
            )
        for req_id, n in self.num_scheduled_tokens.items():
            check_int(f"num_scheduled_tokens[{req_id!r}]", n, minimum=0)
        if not isinstance(self.new_requests, Mapping):
            raise TypeError(
                f"new_requests must be a dict of request id -> token ids, "
                f"got {self.new_requests!r}"
            )
        for req_id, prompt in self.new_requests.items():
            if not isinstance(prompt, (list, tuple)) or not prompt:
                raise ValueError(
                    f"new_requests[{req_id!r}] must be a non-empty list of token ids, "
                    f"got {prompt!r}"
                )
        if not isinstance(self.finished, (list, tuple)):
            raise TypeError(f"finished must be a list of request ids, got {self.finished!r}")
        self.num_scheduled_tokens = {str(k): v for k, v in self.num_scheduled_tokens.items()}
        self.new_requests = {str(k): list(v) for k, v in self.new_requests.items()}
        self.finished = [str(r) for r in self.finished]


@dataclass
class RequestState:
    """One request the runner holds.

    Attributes:
        req_id: Its id.
        token_ids: Prompt, then every token sampled so far.
        num_prompt_tokens: Length of the prompt.
        num_computed: Tokens whose keys and values are in the KV cache.
        region: Index of its KV-cache region.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    region: int

    @property
    def num_pending(self) -> int:
        """Known tokens not yet computed."""
        return len(self.token_ids) - self.num_computed


@dataclass
class InputBatch:
    """The model inputs of one step, padded to ``num_tokens_padded``.

    Attributes:
        req_ids: Requests in batch order.
        num_scheduled: Tokens of each request in the batch, in batch order.
        num_tokens: Real tokens.
        num_tokens_padded: Tokens including padding (the rows of the tensors below).
        input_ids, positions: Per token (padding: token 0 at position 0).
        slot_mapping: KV-cache slot per token (padding: -1).
        attn_metadata: Request layout of the batch.
        sample_req_ids: Requests whose last known token is computed in this step.
        logits_indices: Row of each of those requests' last token.
    """

    req_ids: list[str]
    num_scheduled: list[int]
    num_tokens: int
    num_tokens_padded: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    attn_metadata: AttentionMetadata
    sample_req_ids: list[str]
    logits_indices: torch.Tensor


def prepare_inputs(
    requests: Sequence[RequestState],
    counts: Sequence[int],
    num_tokens_padded: int,
    max_model_len: int,
    device: torch.device,
) -> InputBatch:
    """Lay out ``counts[i]`` next tokens of ``requests[i]`` (in this order), then padding.

    Raises:
        ValueError: a request is scheduled for more tokens than it has pending, beyond
            ``max_model_len``, or the batch is longer than ``num_tokens_padded``.
    """
    total = sum(counts)
    if num_tokens_padded < total:
        raise ValueError(f"num_tokens_padded {num_tokens_padded} is below the {total} tokens")
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    qsl, sample, logits_rows = [0], [], []
    for req, n in zip(requests, counts):
        if n > req.num_pending:
            raise ValueError(
                f"request {req.req_id!r} has {req.num_pending} token(s) to compute, "
                f"{n} were scheduled"
            )
        start = req.num_computed
        if start + n > max_model_len:
            raise ValueError(
                f"request {req.req_id!r} would reach {start + n} tokens, beyond "
                f"max_model_len {max_model_len}"
            )
        ids.extend(req.token_ids[start : start + n])
        pos.extend(range(start, start + n))
        first_slot = req.region * max_model_len + start
        slots.extend(range(first_slot, first_slot + n))
        qsl.append(qsl[-1] + n)
        if start + n == len(req.token_ids):
            sample.append(req.req_id)
            logits_rows.append(qsl[-1] - 1)
    pad = num_tokens_padded - total
    meta = AttentionMetadata(
        query_start_loc=qsl,
        context_lens=[r.num_computed for r in requests],
        kv_starts=[r.region * max_model_len for r in requests],
        num_actual_tokens=total,
    )

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return InputBatch(
        req_ids=[r.req_id for r in requests],
        num_scheduled=list(counts),
        num_tokens=total,
        num_tokens_padded=num_tokens_padded,
        input_ids=tensor(ids + [0] * pad),
        positions=tensor(pos + [0] * pad),
        slot_mapping=tensor(slots + [-1] * pad),
        attn_metadata=meta,
        sample_req_ids=sample,
        logits_indices=tensor(logits_rows),
    )
