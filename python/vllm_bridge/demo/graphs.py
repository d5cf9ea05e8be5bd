"""CUDA-graph capture and replay for the demo model, keyed by
:class:`~vllm_bridge.forward_context.BatchDescriptor` (what vLLM's GPU model runner does
with its ``cudagraph_manager``).

``GraphManager.capture(descriptors)`` takes the descriptors the dispatcher can return, each
with its runtime mode, and for each one:

1. runs the forward pass once eagerly (warm-up: kernels chosen, workspaces allocated);
2. captures it into ``torch.cuda.CUDAGraph`` s, all in one memory pool
   (``torch.cuda.graph_pool_handle()``), reading its inputs from static buffers
   (token ids, positions, KV slots) that stay at the same addresses for every replay:
   * FULL: the whole forward pass, attention included, in one graph;
   * PIECEWISE: each run of dense pieces between attention and the DP collectives in its
     own graph; attention and the collectives run eagerly between them (see
     :class:`~vllm_bridge.demo.model.transformer.Piece`).

A FULL graph would hold the DP collectives, which go through
:func:`~vllm_bridge.dp.dp_all_gather` (an async op waited on with a timeout, maybe via the
CPU): not capturable, so with more than one DP rank FULL descriptors are not captured and
their steps run eagerly, saying why.

``run(descriptor, mode, inputs)`` copies the step's inputs into the static buffers and
replays the descriptor's graphs; the output is read from the graph's static output. A
step whose mode is NONE, or whose descriptor has no graph of that mode, runs eagerly and
the result says so (:class:`GraphRun`).

**Without CUDA** (torch has no graphs on the CPU) the manager keeps the same bookkeeping
(which descriptors are captured, which are skipped and why, which step hit which key) and
"replays" by running each captured segment's pieces on the static buffers, copying the
results into the static outputs: the same buffers, keys and fallbacks as on CUDA, but not
the same execution. An emulated run executes the pieces' Python every step (the MoE
layers' order check and counter, attention's metadata lookup), which a real replay does
not: a captured piece must not depend on per-step Python state, and the CPU run cannot
prove that. Such a run says ``how="emulated"``, never ``"replay"``.
"""

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from vllm_bridge.config import VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.cudagraph_dispatch import CudagraphDispatcher
from vllm_bridge.demo.model.transformer import MoETransformer, Piece
from vllm_bridge.forward_context import BatchDescriptor

__all__ = ["CaptureReport", "ForwardInputs", "GraphManager", "GraphRun", "runner_dispatcher"]

log = logging.getLogger(__name__)

State = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class ForwardInputs:
    """One forward pass's inputs, padded: ``(num_tokens,)`` int64 tensors each."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class GraphRun:
    """What :meth:`GraphManager.run` did.

    Attributes:
        hidden: The forward pass's output. After a replay it is the graph's static output:
            read it before the next run.
        how: ``"replay"`` (CUDA graphs replayed), ``"emulated"`` (no CUDA: the captured
            key was hit and its pieces ran eagerly on the static buffers) or ``"eager"``.
        reason: Why it ran eagerly (``None`` otherwise).
    """

    hidden: torch.Tensor
    how: str
    reason: str | None = None


@dataclass
class CaptureReport:
    """What :meth:`GraphManager.capture` did.

    Attributes:
        captured: The descriptors that got graphs, in capture order, with their mode.
        skipped: The descriptors given that got none, with the reason.
        num_graphs: ``torch.cuda.CUDAGraph`` s captured (0 without CUDA).
        seconds: Wall time of warm-up and capture.
        memory_bytes: Device memory the capture took (free memory before minus after);
            ``None`` without CUDA.
    """

    captured: dict[BatchDescriptor, CUDAGraphMode] = field(default_factory=dict)
    skipped: dict[BatchDescriptor, str] = field(default_factory=dict)
    num_graphs: int = 0
    seconds: float = 0.0
    memory_bytes: int | None = None


ContextFactory = Callable[
    [BatchDescriptor, CUDAGraphMode, ForwardInputs], AbstractContextManager
]


class _Segment:
    """A run of pieces captured as one graph (or, without CUDA, kept to be run)."""

    def __init__(self, pieces: Sequence[Piece], inputs: State) -> None:
        self.pieces = list(pieces)
        self.inputs = inputs
        self.outputs: State = ()
        self.graph: "torch.cuda.CUDAGraph | None" = None

    def _call(self, *state: torch.Tensor) -> State:
        for piece in self.pieces:
            state = piece.fn(*state)
        return state

    def capture(self, pool: object | None) -> None:
        if pool is None:
            self.outputs = self._call(*self.inputs)
            return
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = self._call(*self.inputs)

    def replay(self, state: State) -> State:
        for static, live in zip(self.inputs, state):
            if static.data_ptr() != live.data_ptr():
                static.copy_(live)
        if self.graph is not None:
            self.graph.replay()
        else:
            for static, new in zip(self.outputs, self._call(*self.inputs)):
                if static.data_ptr() != new.data_ptr():
                    static.copy_(new)
        return self.outputs


@dataclass
class _Entry:
    mode: CUDAGraphMode
    steps: list  # _Segment or Piece (run eagerly), in order


class GraphManager:
    """Captures and replays the forward pass of ``model`` per batch descriptor.

    Args:
        model: The model (its :meth:`~MoETransformer.pieces` are what is captured).
        device: The model's device; graphs only on CUDA.
        context: Builds the forward context a capture runs under, given the descriptor,
            the mode and the static inputs (the model runner's ``set_forward_context``).
    """

    def __init__(
        self, model: MoETransformer, device: torch.device, context: ContextFactory
    ) -> None:
        if not isinstance(model, MoETransformer):
            raise TypeError(f"model must be a MoETransformer, got {model!r}")
        self.model = model
        self.device = torch.device(device)
        self.context = context
        self.use_cuda = self.device.type == "cuda"
        self.report = CaptureReport()
        self.hits: dict[BatchDescriptor, int] = {}
        self._entries: dict[BatchDescriptor, _Entry] = {}
        self._captured = False
        self._pool: object | None = None
        self._ids = self._pos = self._slots = torch.zeros(0, dtype=torch.int64)

    def needs_capture(self) -> bool:
        """Nothing captured yet (``capture`` not called)."""
        return not self._captured

    def descriptors(self) -> dict[BatchDescriptor, CUDAGraphMode]:
        """The captured descriptors and their modes."""
        return {d: e.mode for d, e in self._entries.items()}

    @torch.inference_mode()
    def capture(self, descriptors: Mapping[BatchDescriptor, CUDAGraphMode]) -> CaptureReport:
        """Warm up and capture every descriptor given (largest first, as vLLM does, so
        smaller graphs reuse the pool's memory). See the module docstring.

        Raises:
            TypeError: a key is not a BatchDescriptor.
            ValueError: a mode is not FULL or PIECEWISE, or a descriptor has no tokens.
            RuntimeError: this manager has captured already (even nothing).
        """
        if self._captured:
            raise RuntimeError("graphs are captured already; create a new manager")
        for descriptor, mode in descriptors.items():
            if not isinstance(descriptor, BatchDescriptor):
                raise TypeError(f"descriptor must be a BatchDescriptor, got {descriptor!r}")
            if mode not in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
                raise ValueError(f"{descriptor}: mode must be FULL or PIECEWISE, got {mode!r}")
            if descriptor.num_tokens < 1:
                raise ValueError(f"{descriptor}: num_tokens must be >= 1")
        self._captured = True
        if not descriptors:
            return self.report
        size = max(d.num_tokens for d in descriptors)
        self._ids = torch.zeros(size, dtype=torch.int64, device=self.device)
        self._pos = torch.zeros(size, dtype=torch.int64, device=self.device)
        self._slots = torch.full((size,), -1, dtype=torch.int64, device=self.device)
        collectives = any(p.kind == "collective" for p in self.model.pieces())
        if self.use_cuda:
            self._pool = torch.cuda.graph_pool_handle()
            torch.cuda.synchronize(self.device)
            # Each torch.cuda.graph entry empties the allocator's cache: empty it first, or
            # the blocks it frees during capture hide what the graphs take.
            torch.cuda.empty_cache()
            free_before = torch.cuda.mem_get_info(self.device)[0]
        started = time.perf_counter()
        order = sorted(descriptors, key=lambda d: (-d.num_tokens, str(d)))
        for descriptor in order:
            mode = descriptors[descriptor]
            if mode is CUDAGraphMode.FULL and collectives:
                self.report.skipped[descriptor] = (
                    "FULL graph would hold the DP collectives, which are not capturable here"
                )
                continue
            self._entries[descriptor] = self._capture_one(descriptor, mode)
            self.report.captured[descriptor] = mode
        if self.use_cuda:
            torch.cuda.synchronize(self.device)
            self.report.memory_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.report.seconds = time.perf_counter() - started
        self.report.num_graphs = sum(
            1 for e in self._entries.values() for s in e.steps
            if isinstance(s, _Segment) and s.graph is not None
        )
        log.info(
            "graph capture (%s): %d descriptor(s), %d CUDA graph(s), %d skipped, %.2f s, %s",
            "cuda" if self.use_cuda else "emulated without CUDA",
            len(self.report.captured),
            self.report.num_graphs,
            len(self.report.skipped),
            self.report.seconds,
            "n/a" if self.report.memory_bytes is None
            else f"{self.report.memory_bytes / 2**20:.1f} MiB",
        )
        return self.report

    def _static(self, n: int) -> ForwardInputs:
        return ForwardInputs(self._ids[:n], self._pos[:n], self._slots[:n])

    def _capture_one(self, descriptor: BatchDescriptor, mode: CUDAGraphMode) -> _Entry:
        inputs = self._static(descriptor.num_tokens)
        pieces = self.model.pieces()
        if self.use_cuda:
            # Warm-up: one eager pass (kernels chosen, workspaces made) on a side stream,
            # as PyTorch's recipe does: some lazy state is per stream, and the capture runs
            # on torch.cuda.graph's own side stream.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), self.context(descriptor, mode, inputs):
                self.model(inputs.input_ids, inputs.positions)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
        pool = self._pool if self.use_cuda else None
        entry = _Entry(mode, [])
        with self.context(descriptor, mode, inputs):
            if mode is CUDAGraphMode.FULL:
                segment = _Segment(pieces, (inputs.input_ids, inputs.positions))
                segment.capture(pool)
                entry.steps.append(segment)
                return entry
            state: State = (inputs.input_ids, inputs.positions)
            run: list[Piece] = []
            for piece in pieces + [None]:
                if piece is not None and piece.kind == "dense":
                    run.append(piece)
                    continue
                if run:
                    # The first segment reads the static buffers; later ones get their
                    # own static inputs (allocated here, outside the capture), which
                    # each replay fills from the eager piece before.
                    first = not entry.steps
                    inputs_static = state if first else tuple(t.clone() for t in state)
                    segment = _Segment(run, inputs_static)
                    segment.capture(pool)
                    entry.steps.append(segment)
                    state, run = segment.outputs, []
                if piece is not None:
                    entry.steps.append(piece)
                    state = piece.fn(*state)
        return entry

    # Inference mode: the static buffers were made under it (in capture), and copying into
    # them outside it is refused by torch.
    @torch.inference_mode()
    def run(
        self, descriptor: BatchDescriptor, mode: CUDAGraphMode, inputs: ForwardInputs
    ) -> GraphRun:
        """The forward pass of ``inputs`` (padded to ``descriptor.num_tokens``), by graph
        when the descriptor has one of ``mode``, else eagerly. Must run inside the step's
        forward context (the eager pieces read it)."""
        if not isinstance(descriptor, BatchDescriptor):
            raise TypeError(f"descriptor must be a BatchDescriptor, got {descriptor!r}")
        if not isinstance(mode, CUDAGraphMode):
            raise TypeError(f"mode must be a CUDAGraphMode, got {mode!r}")
        entry = self._entries.get(descriptor)
        reason = None
        if mode is CUDAGraphMode.NONE:
            reason = "runtime mode NONE"
        elif entry is None:
            reason = self.report.skipped.get(descriptor, f"no graph captured for {descriptor}")
        elif entry.mode is not mode:
            reason = f"{descriptor} was captured as {entry.mode.name}, the step runs {mode.name}"
        if reason is not None or entry is None:
            return GraphRun(self.model(inputs.input_ids, inputs.positions), "eager", reason)
        n = descriptor.num_tokens
        if inputs.num_tokens != n:
            raise ValueError(f"{descriptor}: the inputs have {inputs.num_tokens} tokens, not {n}")
        static = self._static(n)
        static.input_ids.copy_(inputs.input_ids)
        static.positions.copy_(inputs.positions)
        static.slot_mapping.copy_(inputs.slot_mapping)
        state: State = (static.input_ids, static.positions)
        for step in entry.steps:
            state = step.replay(state) if isinstance(step, _Segment) else step.fn(*state)
        self.hits[descriptor] = self.hits.get(descriptor, 0) + 1
        return GraphRun(state[0], "replay" if self.use_cuda else "emulated")


# What a DP rank's FULL graph cannot hold: the MoE layers' collectives run between the
# pieces (vLLM likewise downgrades the mode when a backend cannot run FULL graphs).
_WITHOUT_FULL = {
    CUDAGraphMode.FULL: CUDAGraphMode.PIECEWISE,
    CUDAGraphMode.FULL_AND_PIECEWISE: CUDAGraphMode.PIECEWISE,
    CUDAGraphMode.FULL_DECODE_ONLY: CUDAGraphMode.NONE,
}


def runner_dispatcher(config: VllmConfig, max_num_reqs: int, dp_size: int) -> CudagraphDispatcher:
    """The runner's dispatcher: no decode graph for more requests than the runner holds
    (``max_num_seqs`` capped by ``max_num_reqs``, the KV-cache regions), and, with more
    than one DP rank, no FULL graph (the mode downgraded as :data:`_WITHOUT_FULL` says), so
    that every key it returns is one the graph manager captures."""
    scheduler = config.scheduler_config
    if scheduler.max_num_seqs > max_num_reqs:
        scheduler = dataclasses.replace(scheduler, max_num_seqs=max_num_reqs)
        config = dataclasses.replace(config, scheduler_config=scheduler)
    mode = config.compilation_config.cudagraph_mode
    if dp_size > 1:
        mode = _WITHOUT_FULL.get(mode, mode)
    return CudagraphDispatcher(config, cudagraph_mode=mode)
