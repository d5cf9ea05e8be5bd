"""CUDA graphs of micro-batched runs: the part of
:class:`~vllm_bridge.ubatch_wrapper.UBatchWrapper` that captures a whole micro-batched
run (both threads, both streams) in one graph per token count and replays it.

Only on CUDA and only in FULL mode (:func:`ubatch_graph_action`); without CUDA a FULL
step runs eagerly on the threads like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import get_forward_context, override_forward_context

if TYPE_CHECKING:
    from vllm_bridge.ubatch_metadata import UbatchMetadata

__all__ = ["CUDAGraphMetaData", "UBatchGraphs", "ubatch_graph_action"]


@dataclass
class CUDAGraphMetaData:
    """A captured micro-batched run: the graph, the micro-batches it was captured with
    (their inputs are slices of ``static_inputs``, which each replay refills; their
    forward contexts, attention metadata and slot mapping included, are those of capture
    time and are not refreshed) and its output (the graph's static output: read it before
    the next replay)."""

    cudagraph: Any  # torch.cuda.CUDAGraph
    ubatch_metadata: list[UbatchMetadata]
    outputs: Any | None = None
    static_inputs: dict[str, torch.Tensor] | None = None


def ubatch_graph_action(
    mode: CUDAGraphMode, num_tokens: int, captured: dict[int, Any] | set[int], graphs: bool
) -> str:
    """What a micro-batched run of ``num_tokens`` tokens does under runtime ``mode``:
    ``"capture"`` (FULL, no graph of that size yet), ``"replay"`` (FULL, captured) or
    ``"eager"`` (any other mode, or ``graphs`` False: no CUDA)."""
    if mode is not CUDAGraphMode.FULL or not graphs:
        return "eager"
    return "replay" if num_tokens in captured else "capture"


class UBatchGraphs:
    """Capture and replay of micro-batched runs; mixed into ``UBatchWrapper``, whose
    ``_make_ubatch_metadata`` it uses, and the ``_start_threads``, ``_join``, ``_finish``,
    ``_abandon`` and ``_run_ubatches`` of its other mixin
    (:class:`~vllm_bridge.ubatch_threads.UBatchThreads`)."""

    cudagraphs: dict[int, CUDAGraphMetaData]
    graph_pool: Any
    device: torch.device
    last_run: str | None

    def _capture_ubatches(
        self, ubatch_metadata: list[UbatchMetadata], model: Callable[..., Any], kwargs: dict
    ) -> Any:
        """Capture a micro-batched run in one CUDA graph, stored by token count.

        The threads start first and each creates its CUDA state before going to sleep in
        its context; then the main thread begins the capture on the compute stream and
        wakes micro-batch 0; the threads run to the end (their kernels, on the capture
        stream and the comm stream forked from it, go into the graph); the main thread
        stores the graph and replays it once for this call's output.

        Only ``input_ids``, ``positions`` and ``inputs_embeds`` are refreshed by a replay
        (see the wrapper module's docstring): not the attention metadata or slot mapping.
        """
        num_tokens = sum(m.num_tokens for m in ubatch_metadata)
        # Warm-up (kernels chosen, workspaces allocated) by one eager micro-batched run;
        # a fresh set of contexts for the capture itself.
        self._run_ubatches(ubatch_metadata, model)
        context = get_forward_context()
        static = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        metadata = self._make_ubatch_metadata(
            ubatch_slices=context.ubatch_slices,
            attn_metadata=context.attn_metadata,
            input_ids=static["input_ids"],
            positions=static["positions"],
            inputs_embeds=static.get("inputs_embeds"),
            intermediate_tensors=kwargs.get("intermediate_tensors"),
            compute_stream=side,
            dp_metadata=context.dp_metadata,
            batch_descriptor=context.batch_descriptor,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            slot_mapping=context.slot_mapping,
        )
        graph = CUDAGraphMetaData(torch.cuda.CUDAGraph(), metadata, static_inputs=static)
        with override_forward_context(None):
            try:
                results = self._start_threads(metadata, model, capture=True)
                with torch.cuda.graph(graph.cudagraph, stream=side, pool=self.graph_pool):
                    metadata[0].context.cpu_wait_event.set()
                    self._join(metadata[0].context.run)
                    graph.outputs = self._finish(metadata, results)
            except BaseException as exc:
                # The run's own failure (ended with the peers by _finish), or the main
                # thread's (an interrupt, a capture error): the run is ended if it was not.
                self._abandon(metadata, exc)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.cudagraphs[num_tokens] = graph
        out = self._replay(num_tokens, kwargs)
        self.last_run = "captured"
        return out

    def _replay(self, num_tokens: int, kwargs: dict) -> Any:
        graph = self.cudagraphs[num_tokens]
        for name, buffer in (graph.static_inputs or {}).items():
            buffer.copy_(kwargs[name])
        graph.cudagraph.replay()
        self.last_run = "replayed"
        return graph.outputs
