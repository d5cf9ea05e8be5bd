"""What one step of the demo's model runner did and produced (:class:`StepOutput`): the
value :meth:`~vllm_bridge.demo.model_runner.ModelRunner.execute_model` returns and
:func:`vllm_bridge.demo.rank.execute_model` sends to the Elixir side as a dict.

Apart from the runner because it is plain data that outlives the step: the rank module,
the benches and the tests read it without running anything. Its public name stays
``vllm_bridge.demo.model_runner.StepOutput`` (re-exported there, and named so in the
generated bindings' docs).
"""

from dataclasses import dataclass, field

import torch

from vllm_bridge.forward_context import BatchDescriptor

__all__ = ["StepOutput"]


@dataclass
class StepOutput:
    """What one step did and produced.

    Attributes:
        num_tokens: This rank's real tokens.
        num_tokens_padded: Tokens the forward pass ran (real + padding).
        num_tokens_across_dp: Every DP rank's padded count (``None`` without DP).
        num_reqs: Requests in the batch.
        uniform_decode: Every request computes exactly one token.
        should_ubatch: The ranks agreed to micro-batch.
        ubatch_num_tokens: Tokens of each micro-batch (padded), when micro-batched.
        cudagraph_mode: The agreed runtime mode (``"NONE"``, ``"PIECEWISE"``, ``"FULL"``).
        batch_descriptor: The descriptor the pass ran under (``None`` when skipped).
        moe_chunks: DP chunks each MoE layer walked (0 without DP).
        forward_ms: Wall time of the forward pass and sampling.
        step_ms: Wall time of the whole step, coordination included.
        req_ids: The requests that got a token, in batch order.
        sampled_token_ids: The token each of them got (greedy).
        logits: Their logits, ``(len(req_ids), vocab_size)`` float32 on the CPU.
        skipped: No rank had a token: nothing ran.
        graph: How the forward pass ran: ``"replay"`` (CUDA graphs), ``"emulated"`` (no
            CUDA: the descriptor's captured pieces ran eagerly) or ``"eager"``.
        graph_reason: Why it ran eagerly (``None`` otherwise).
        ubatch_run: How the micro-batches ran (``None`` when not micro-batched):
            ``"overlapped"`` (two threads taking turns at the MoE collectives,
            :class:`~vllm_bridge.ubatch_wrapper.UBatchWrapper`) or ``"sequential"`` (one
            after the other on the calling thread).
    """

    num_tokens: int = 0
    num_tokens_padded: int = 0
    num_tokens_across_dp: list[int] | None = None
    num_reqs: int = 0
    uniform_decode: bool = False
    should_ubatch: bool = False
    ubatch_num_tokens: list[int] | None = None
    cudagraph_mode: str = "NONE"
    batch_descriptor: BatchDescriptor | None = None
    moe_chunks: int = 0
    forward_ms: float = 0.0
    step_ms: float = 0.0
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logits: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))
    skipped: bool = False
    graph: str = "eager"
    graph_reason: str | None = None
    ubatch_run: str | None = None
