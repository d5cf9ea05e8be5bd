"""UBatchWrapper in one process: the threads, the turns, the contexts, failures, graph
keying and SM control. The DP runs (real gloo groups) are in tests/demo/test_ubatch_overlap.py.

The runnable here is a small model whose "layers" compute, then hand over at a stand-in
collective (an already-complete work object, through the same UBatchContext calls the DP
collectives make), and record what they did.
"""

import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from vllm_bridge.config import ParallelConfig, VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import (
    DPMetadata,
    create_forward_context,
    get_forward_context,
    is_forward_context_available,
    override_forward_context,
)
from vllm_bridge.sm_control import SMControlContextManager, create_sm_control
from vllm_bridge.ubatch import UBatchSlice
from vllm_bridge.ubatch_wrapper import UBatchWrapper, ubatch_graph_action
from vllm_bridge.ubatching import current_ubatch_context, set_fault_injector

CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device (none is available here)"


class _Done:
    """A collective's work that has completed (the stand-in's)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass
class Toy:
    """``layers`` rounds of: scale the tokens, then a stand-in collective (``x * 0.5``
    computed as the collective is launched: on CUDA on the comm stream) handed over at,
    and its result added once it is waited on."""

    layers: int = 3
    fail_at: tuple[int, int] | None = None  # (micro-batch, layer)

    def __post_init__(self) -> None:
        self.log: list[tuple[int, int, Any]] = []
        self.lock = threading.Lock()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = input_ids.float() * 2 + positions.float()
        ctx = current_ubatch_context()
        me = ctx.id if ctx is not None else -1
        tag = get_forward_context().attn_metadata if is_forward_context_available() else None
        for layer in range(self.layers):
            with self.lock:
                self.log.append((me, layer, tag))
            if self.fail_at == (me, layer):
                raise ValueError(f"toy failure in micro-batch {me} at layer {layer}")
            x = x * 1.5 + layer
            if ctx is None:
                x = x + x * 0.5
                continue
            comm: list[torch.Tensor] = []
            work = ctx.launch("toy", lambda: (comm.append(x * 0.5), _Done())[1])
            ctx.handover("toy")
            ctx.wait("toy", work, 5.0)
            x = x + comm[0]
        return x


def _config() -> VllmConfig:
    return VllmConfig(parallel_config=ParallelConfig(is_moe_model=True))


def _context(slices: list[UBatchSlice], mode: CUDAGraphMode = CUDAGraphMode.NONE):
    return create_forward_context(
        [f"meta-{i}" for i in range(len(slices))],
        _config(),
        ubatch_slices=slices,
        cudagraph_runtime_mode=mode,
    )


SLICES = [UBatchSlice(slice(0, 2), slice(0, 5)), UBatchSlice(slice(2, 3), slice(5, 8))]


def _inputs(n: int = 8) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.arange(n) * 3, "positions": torch.arange(n)}


def _ubatch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("vllm-bridge-ubatch")]


def test_micro_batches_take_turns_each_under_its_own_context() -> None:
    toy = Toy()
    wrapper = UBatchWrapper(toy, _config(), CUDAGraphMode.NONE, "cpu")
    outer = _context(SLICES)
    with override_forward_context(outer):
        out = wrapper(**_inputs())
        assert get_forward_context() is outer  # the caller's context is back
    assert torch.equal(out, Toy()(**_inputs()))  # as one pass over all tokens
    assert wrapper.last_run == "overlapped"
    # Strict alternation at the hand-over points, micro-batch 0 first; each thread saw its
    # own forward context (its attention metadata).
    assert toy.log == [(i, layer, f"meta-{i}") for layer in range(3) for i in (0, 1)]
    assert _ubatch_threads() == []


def test_without_slices_the_runnable_runs_plainly() -> None:
    toy = Toy()
    wrapper = UBatchWrapper(toy, _config(), CUDAGraphMode.NONE, "cpu")
    with override_forward_context(create_forward_context(None, _config())):
        out = wrapper(**_inputs())
    assert torch.equal(out, Toy()(**_inputs())) and {e[0] for e in toy.log} == {-1}
    assert wrapper.last_run is None
    assert wrapper.layers == 3  # attributes of the runnable show through


@pytest.mark.parametrize("fail_at", [(0, 0), (1, 0), (0, 2), (1, 2)])
def test_a_failing_micro_batch_ends_the_call_with_its_error_and_the_next_runs(
    fail_at: tuple[int, int]
) -> None:
    toy = Toy(fail_at=fail_at)
    wrapper = UBatchWrapper(toy, _config(), CUDAGraphMode.NONE, "cpu")
    with override_forward_context(_context(SLICES)):
        with pytest.raises(ValueError, match=f"micro-batch {fail_at[0]} at layer {fail_at[1]}"):
            wrapper(**_inputs())
        assert _ubatch_threads() == []
        assert wrapper.ready_barrier.n_waiting == 0  # nobody left waiting at the barrier
        toy.fail_at = None
        assert torch.equal(wrapper(**_inputs()), Toy()(**_inputs()))


@pytest.mark.parametrize("where", ["launch", "resume"])
@pytest.mark.parametrize("ubatch", [0, 1])
def test_an_injected_fault_at_a_hand_over_point_ends_the_call(where: str, ubatch: int) -> None:
    seen = []

    def injector(point: Any) -> None:
        seen.append(point)
        if (point.ubatch_id, point.index, point.where) == (ubatch, 1, where):
            raise RuntimeError(f"injected at {point}")

    wrapper = UBatchWrapper(Toy(), _config(), CUDAGraphMode.NONE, "cpu")
    set_fault_injector(injector)
    try:
        with override_forward_context(_context(SLICES)):
            with pytest.raises(RuntimeError, match="injected at"):
                wrapper(**_inputs())
    finally:
        set_fault_injector(None)
    assert _ubatch_threads() == []
    assert any(p.ubatch_id == 1 - ubatch for p in seen)  # the other thread ran too
    with override_forward_context(_context(SLICES)):
        assert torch.equal(wrapper(**_inputs()), Toy()(**_inputs()))


def test_set_fault_injector_refuses_a_non_callable() -> None:
    with pytest.raises(TypeError, match="injector must be callable"):
        set_fault_injector(3)  # type: ignore[arg-type]


def test_ubatch_metadata_slices_inputs_and_counts_each_micro_batch() -> None:
    wrapper = UBatchWrapper(Toy(), _config(), CUDAGraphMode.NONE, "cpu")
    dp_meta = DPMetadata(torch.tensor(8), torch.tensor([8, 8], dtype=torch.int32))
    metas = wrapper._make_ubatch_metadata(
        SLICES, ["a", "b"], torch.arange(8), torch.arange(8) + 100, None, None, None,
        None, None, CUDAGraphMode.NONE, slot_mapping=[{"l": torch.arange(5)}, {"l": torch.arange(3)}],
    )
    assert [m.num_tokens for m in metas] == [5, 3]
    assert metas[1].input_ids.tolist() == [5, 6, 7] and metas[1].positions.tolist() == [105, 106, 107]
    assert [m.context.forward_context.attn_metadata for m in metas] == ["a", "b"]
    assert all(m.context.compute_stream is None and m.context.comm_stream is None for m in metas)
    # M-RoPE positions (3, tokens) are sliced on the token axis.
    _, pos, _, _ = wrapper._slice_model_inputs(slice(5, 8), torch.arange(8), torch.zeros(3, 8), None, None)
    assert pos.shape == (3, 3)
    # DP counts of each micro-batch's own size (needs a DP config: checked without a group).
    from vllm_bridge.ubatch_wrapper import _ubatch_dp_metadata
    dp_config = VllmConfig(
        parallel_config=ParallelConfig(data_parallel_size=2, is_moe_model=True)
    )
    counts = _ubatch_dp_metadata(dp_config, dp_meta, 3).num_tokens_across_dp_cpu
    assert counts.tolist() == [3, 3]
    with pytest.raises(ValueError, match="attn_metadata of a micro-batched pass must be a list of 2"):
        wrapper._make_ubatch_metadata(
            SLICES, {"l": 1}, torch.arange(8), torch.arange(8), None, None, None, None, None,
            CUDAGraphMode.NONE,
        )


def test_graph_action_is_keyed_by_token_count_in_full_mode_only() -> None:
    full, pw, none = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE
    assert ubatch_graph_action(full, 8, {}, graphs=True) == "capture"
    assert ubatch_graph_action(full, 8, {8: object()}, graphs=True) == "replay"
    assert ubatch_graph_action(full, 16, {8: object()}, graphs=True) == "capture"
    assert ubatch_graph_action(pw, 8, {8: object()}, graphs=True) == "eager"
    assert ubatch_graph_action(none, 8, {}, graphs=True) == "eager"
    assert ubatch_graph_action(full, 8, {}, graphs=False) == "eager"


def test_full_mode_without_cuda_runs_eagerly_and_captures_nothing() -> None:
    wrapper = UBatchWrapper(Toy(), _config(), CUDAGraphMode.FULL, "cpu")
    with override_forward_context(_context(SLICES, CUDAGraphMode.FULL)):
        out = wrapper(**_inputs())
    assert torch.equal(out, Toy()(**_inputs()))
    assert wrapper.last_run == "overlapped" and wrapper.cudagraphs == {}
    assert wrapper.graph_pool is None and wrapper.comm_stream is None


def test_wrapper_refuses_bad_arguments() -> None:
    with pytest.raises(TypeError, match="runnable must be callable"):
        UBatchWrapper(3, _config(), CUDAGraphMode.NONE, "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="runtime_mode must be a CUDAGraphMode"):
        UBatchWrapper(Toy(), _config(), "FULL", "cpu")  # type: ignore[arg-type]
    wrapper = UBatchWrapper(Toy(), _config(), CUDAGraphMode.NONE, "cpu")
    with override_forward_context(_context(SLICES)):
        with pytest.raises(TypeError, match="keyword arguments only"):
            wrapper(torch.arange(8), torch.arange(8))


# -- SM control -------------------------------------------------------------------------------


def _recording() -> tuple[list, SMControlContextManager]:
    calls: list[tuple[str, int]] = []
    manager = SMControlContextManager(
        10, lambda n: calls.append(("comm", n)), lambda n: calls.append(("compute", n)),
        total_sms=132,
    )
    return calls, manager


def test_sm_control_sets_the_split_on_enter_and_all_sms_on_exit() -> None:
    calls, manager = _recording()
    with manager:
        assert calls == [("comm", 10), ("compute", 122)]
    assert calls[2:] == [("comm", 132), ("compute", 132)]
    assert (manager.total_sms, manager.comm_sms, manager.compute_sms) == (132, 10, 122)


def test_sm_control_restores_all_sms_when_the_body_raises() -> None:
    calls, manager = _recording()
    with pytest.raises(KeyError):
        with manager:
            raise KeyError("boom")
    assert calls == [("comm", 10), ("compute", 122), ("comm", 132), ("compute", 132)]


@pytest.mark.parametrize("comm", [132, 200, -1])
def test_sm_control_refuses_a_comm_count_outside_the_device(comm: int) -> None:
    with pytest.raises(ValueError, match=rf"< total_sms \(132\), got {comm}"):
        SMControlContextManager(comm, print, print, total_sms=132)


def test_sm_control_refuses_bad_setters_and_counts() -> None:
    with pytest.raises(TypeError, match="set_compute_sms must be callable"):
        SMControlContextManager(1, print, None, total_sms=8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="comm_sms must be an int"):
        SMControlContextManager(1.5, print, print, total_sms=8)  # type: ignore[arg-type]


@pytest.mark.skipif(CUDA, reason="checks the refusal without a CUDA device")
def test_sm_control_without_cuda_needs_a_total() -> None:
    with pytest.raises(ValueError, match="need a CUDA device"):
        SMControlContextManager(1, print, print)
    manager = create_sm_control(_config(), torch.device("cpu"))
    assert (manager.comm_sms, manager.total_sms) == (0, 1)


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
def test_sm_control_on_cuda_reads_the_device_sm_count() -> None:
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    calls: list[int] = []
    manager = SMControlContextManager(4, calls.append, calls.append)
    assert (manager.total_sms, manager.compute_sms) == (total, total - 4)
    with manager:
        pass
    assert calls == [4, total - 4, total, total]
    real = create_sm_control(_config(), torch.device("cuda"))
    assert real.total_sms == total and 0 <= real.comm_sms < total
    with real:  # the no-op setters (torch offers no per-kernel SM limit) run without error
        pass


# -- CUDA: streams and graphs of micro-batched runs -----------------------------------------


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
def test_on_cuda_each_micro_batch_has_compute_and_comm_streams() -> None:
    wrapper = UBatchWrapper(Toy(), _config(), CUDAGraphMode.NONE, "cuda")
    metas = wrapper._make_ubatch_metadata(
        SLICES, ["a", "b"], torch.arange(8, device="cuda"), torch.arange(8, device="cuda"),
        None, None, torch.cuda.current_stream(), None, None, CUDAGraphMode.NONE,
    )
    for meta in metas:
        assert meta.context.compute_stream == torch.cuda.current_stream()
        assert meta.context.comm_stream is wrapper.comm_stream
        assert meta.context.comm_stream != meta.context.compute_stream
    inputs = {k: v.cuda() for k, v in _inputs().items()}
    with override_forward_context(_context(SLICES)):
        out = wrapper(**inputs)
    torch.testing.assert_close(out, Toy()(**inputs))


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
def test_full_mode_captures_a_micro_batched_run_and_replays_it_by_token_count() -> None:
    toy = Toy()
    wrapper = UBatchWrapper(toy, _config(), CUDAGraphMode.FULL, "cuda")
    first = {k: v.cuda() for k, v in _inputs().items()}
    with override_forward_context(_context(SLICES, CUDAGraphMode.FULL)):
        out = wrapper(**first).clone()
        assert wrapper.last_run == "captured" and set(wrapper.cudagraphs) == {8}
        torch.testing.assert_close(out, Toy()(**first))
        # Same size, new inputs: a replay computes them (the graph reads static buffers).
        second = {k: v * 2 + 1 for k, v in first.items()}
        log_before = len(toy.log)
        out2 = wrapper(**second).clone()
        assert wrapper.last_run == "replayed" and len(toy.log) == log_before  # no Python ran
        torch.testing.assert_close(out2, Toy()(**second))
    bigger = [UBatchSlice(slice(0, 2), slice(0, 6)), UBatchSlice(slice(2, 4), slice(6, 12))]
    with override_forward_context(_context(bigger, CUDAGraphMode.FULL)):
        third = {k: v.cuda() for k, v in _inputs(12).items()}
        torch.testing.assert_close(wrapper(**third), Toy()(**third))
    assert set(wrapper.cudagraphs) == {8, 12}
    assert _ubatch_threads() == []
