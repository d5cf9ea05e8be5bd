"""The requests a demo model runner holds (their tokens, what is computed, their KV-cache
regions), and the checks a step passes before it changes any of them."""

from vllm_bridge.demo.batch import InputBatch, RequestState, SchedulerStep

__all__ = ["apply_step", "after_step"]


def apply_step(
    requests: dict[str, RequestState],
    free_regions: list[int],
    step: SchedulerStep,
    *,
    vocab_size: int,
    max_model_len: int,
    max_num_reqs: int,
) -> None:
    """Apply finished and new requests. Checks everything first (ids, token ids, the
    tokens each request can compute, the length limit): a refused step changes
    nothing, and is refused before this rank enters the step's collectives."""
    vocab = vocab_size
    staying = set(requests) - set(step.finished)
    for req_id, prompt in step.new_requests.items():
        if req_id in staying:
            raise ValueError(f"request {req_id!r} is already running")
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise ValueError(
                    f"request {req_id!r}: token id {token!r} is not in 0..{vocab - 1}"
                )
    known = staying | set(step.new_requests)
    unknown = [r for r in step.num_scheduled_tokens if r not in known]
    if unknown:
        raise ValueError(f"scheduled request(s) {unknown} are not running (never added?)")
    max_len = max_model_len
    for req_id, n in step.num_scheduled_tokens.items():
        if req_id in step.new_requests:
            computed, known_tokens = 0, len(step.new_requests[req_id])
        else:
            state = requests[req_id]
            computed, known_tokens = state.num_computed, len(state.token_ids)
        if n > known_tokens - computed:
            raise ValueError(
                f"request {req_id!r} has {known_tokens - computed} token(s) to compute, "
                f"{n} were scheduled"
            )
        if computed + n > max_len:
            raise ValueError(
                f"request {req_id!r} would reach {computed + n} tokens, beyond "
                f"max_model_len {max_len}"
            )
    freed = [requests[r].region for r in step.finished if r in requests]
    if len(staying) + len(step.new_requests) > max_num_reqs:
        raise ValueError(
            f"{len(staying) + len(step.new_requests)} requests would run at once; "
            f"this runner holds at most max_num_reqs={max_num_reqs}"
        )
    for req_id in step.finished:
        requests.pop(req_id, None)
    free_regions.extend(freed)
    for req_id, prompt in step.new_requests.items():
        region = free_regions.pop(0)
        requests[req_id] = RequestState(req_id, list(prompt), len(prompt), 0, region)


def after_step(
    requests: dict[str, RequestState], batch: InputBatch, sampled: list[int]
) -> None:
    """Count what the step computed and append the tokens it sampled."""
    for req_id, n in zip(batch.req_ids, batch.num_scheduled):
        requests[req_id].num_computed += n
    for req_id, token in zip(batch.sample_req_ids, sampled):
        requests[req_id].token_ids.append(int(token))
