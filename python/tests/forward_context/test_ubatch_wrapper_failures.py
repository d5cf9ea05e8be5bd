"""UBatchWrapper failures in one process: the main thread interrupted while it waits, a
long but healthy step, slice counts the run was not sized for, a thread failing before
the barrier, the main thread's own barrier timeout, and the outcome exchange failing (a
1-rank gloo DP group with its store made to raise). The 2-rank runs are in
tests/demo/test_ubatch_overlap.py.
"""

import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dp_env import free_port
import vllm_bridge.ubatch_threads as ubatch_threads
from test_ubatch_wrapper import SLICES, Toy, _config, _context, _Done, _inputs, _ubatch_threads
from vllm_bridge import dp
from vllm_bridge.config import ParallelConfig, VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import DPMetadata, create_forward_context, override_forward_context
from vllm_bridge.ubatch import UBatchSlice
from vllm_bridge.ubatch_wrapper import UBatchWrapper
from vllm_bridge.ubatching import (
    UBatchAbortedError,
    UBatchContext,
    current_ubatch_context,
    set_fault_injector,
)

# Every hand-over point of a Toy(layers=2) run: (micro-batch, collective, where).
POINTS = [(u, i, w) for u in (0, 1) for i in (0, 1) for w in ("launch", "resume")]


class Interrupted(BaseException):
    """Raised in the main thread by the test's signal handler (as the worker's cancel
    raises CallInterrupted, and Ctrl-C KeyboardInterrupt)."""


@pytest.fixture
def interrupt_signal() -> Iterator[int]:
    def handler(signum: int, frame: Any) -> None:
        raise Interrupted("interrupted while waiting for the micro-batches")

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        yield signal.SIGUSR1
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("point", POINTS)
def test_the_main_thread_interrupted_at_any_hand_over_point_ends_the_run(
    interrupt_signal: int, point: tuple[int, int, str]
) -> None:
    main = threading.main_thread().ident
    fired: list[Any] = []

    def injector(p: Any) -> None:
        if (p.ubatch_id, p.index, p.where) != point or fired:
            return
        fired.append(p)
        signal.pthread_kill(main, interrupt_signal)
        # Hold the turn until the main thread has failed the run (bounded).
        run = current_ubatch_context().run
        deadline = time.monotonic() + 10
        while run.error is None and time.monotonic() < deadline:
            time.sleep(0.005)

    wrapper = UBatchWrapper(Toy(layers=2), _config(), CUDAGraphMode.NONE, "cpu")
    set_fault_injector(injector)
    try:
        with override_forward_context(_context(SLICES)):
            with pytest.raises(Interrupted):
                wrapper(**_inputs())
            # The call returned only once its threads had ended.
            assert _ubatch_threads() == [], f"threads left after an interrupt at {point}"
            assert fired and wrapper.last_run is None
            set_fault_injector(None)
            assert torch.equal(wrapper(**_inputs()), Toy(layers=2)(**_inputs()))
            assert wrapper.last_run == "overlapped"
    finally:
        set_fault_injector(None)


class SlowToy(Toy):
    """Each layer computes for ``sleep_s`` before handing over: a long step in which every
    single wait is short."""

    sleep_s = 0.1

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = current_ubatch_context()
        x = input_ids.float()
        for _ in range(self.layers):
            time.sleep(self.sleep_s)
            x = x + 1
            work = ctx.launch("toy", _Done)
            ctx.handover("toy")
            ctx.wait("toy", work, 5.0)
        return x


def test_a_long_step_whose_every_wait_is_short_is_not_cut_short(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Waits bounded by 2 x 0.5 s; the whole step takes 8 layers x 2 threads x 0.1 s.
    monkeypatch.setattr(dp, "DEFAULT_TIMEOUT_S", 0.5)
    # (Where _join reads it: set on the wrapper's module, it would change nothing.)
    monkeypatch.setattr(ubatch_threads, "JOIN_MARGIN_S", 0.0)
    wrapper = UBatchWrapper(SlowToy(layers=8), _config(), CUDAGraphMode.NONE, "cpu")
    started = time.monotonic()
    with override_forward_context(_context(SLICES)):
        out = wrapper(**_inputs())
    # Not a timing assertion: the premise of the test (longer than 2 x timeout).
    assert time.monotonic() - started > 2 * 0.5
    assert torch.equal(out, _inputs()["input_ids"].float() + 8)
    assert wrapper.last_run == "overlapped" and _ubatch_threads() == []


THREE = [
    UBatchSlice(slice(0, 1), slice(0, 3)),
    UBatchSlice(slice(1, 2), slice(3, 5)),
    UBatchSlice(slice(2, 3), slice(5, 8)),
]


@pytest.mark.parametrize("slices", [THREE, SLICES[:1]], ids=["three", "one"])
def test_a_slice_count_other_than_num_ubatches_is_refused_at_once(
    slices: list[UBatchSlice],
) -> None:
    wrapper = UBatchWrapper(Toy(), _config(), CUDAGraphMode.NONE, "cpu")
    with override_forward_context(_context(slices)):
        with pytest.raises(
            ValueError, match=rf"len\(ubatch_slices\) = {len(slices)}, but num_ubatches = 2"
        ):
            wrapper(**_inputs())
    assert _ubatch_threads() == []


class SetUp(UBatchWrapper):
    """A wrapper whose micro-batch ``who`` fails (or stalls) in its own set-up, before the
    barrier (where a CUDA thread sets its device and creates its cuBLAS handle)."""

    who = 1
    stall_s = 0.0

    def _thread_setup(self, ctx: UBatchContext, capture: bool) -> None:
        if ctx.id == self.who:
            if self.stall_s:
                time.sleep(self.stall_s)
            else:
                raise OSError(f"no device for micro-batch {ctx.id}")
        super()._thread_setup(ctx, capture)


@pytest.mark.parametrize("who", [0, 1])
def test_a_thread_failing_before_the_barrier_ends_the_call_with_its_error(who: int) -> None:
    wrapper = SetUp(Toy(), _config(), CUDAGraphMode.NONE, "cpu")
    wrapper.who = who
    with override_forward_context(_context(SLICES)):
        with pytest.raises(OSError, match=f"no device for micro-batch {who}"):
            wrapper(**_inputs())
        assert _ubatch_threads() == []
        wrapper.who = -2
        assert torch.equal(wrapper(**_inputs()), Toy()(**_inputs()))


def test_the_main_threads_barrier_timeout_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp, "DEFAULT_TIMEOUT_S", 0.3)
    wrapper = SetUp(Toy(), _config(), CUDAGraphMode.NONE, "cpu")
    wrapper.stall_s = 1.0  # micro-batch 1 reaches the barrier after the main one gave up
    with override_forward_context(_context(SLICES)):
        with pytest.raises(TimeoutError, match="did not all reach the ready barrier within 0.3 s"):
            wrapper(**_inputs())
    assert _ubatch_threads() == []


# -- with a (1-rank) DP group: the run is ended through the group's store ---------------------


class RaisingStore:
    """The group's store, made to fail when a run's outcome is written (an injected fault:
    the store itself, e.g. its host gone)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def set(self, key: str, value: Any) -> None:
        if "/done/" in key:
            raise RuntimeError(f"store unreachable writing {key}")
        self.store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dp.init_dp_group(0, 1, "127.0.0.1", free_port(), "gloo", 5.0)
    try:
        yield
    finally:
        dp.destroy_dp_group()


def _dp_config() -> VllmConfig:
    # The config of a DP run (DP metadata needs data_parallel_size > 1); the group that
    # ends the run is this process's 1-rank one (the toy issues no DP collective).
    parallel = ParallelConfig(data_parallel_size=2, data_parallel_rank=0, is_moe_model=True)
    return VllmConfig(parallel_config=parallel)


def _dp_context() -> Any:
    dp_meta = DPMetadata(torch.tensor(8), torch.tensor([8, 8], dtype=torch.int32))
    return create_forward_context(
        ["meta-0", "meta-1"], _dp_config(), dp_metadata=dp_meta, ubatch_slices=SLICES
    )


def test_a_failing_outcome_exchange_ends_the_call_and_marks_the_group_broken(
    one_rank_group: None,
) -> None:
    wrapper = UBatchWrapper(Toy(), _dp_config(), CUDAGraphMode.NONE, "cpu")
    with override_forward_context(_dp_context()):
        assert torch.equal(wrapper(**_inputs()), Toy()(**_inputs()))  # the store works
        dp._state.store = RaisingStore(dp._state.store)
        with pytest.raises(UBatchAbortedError, match="store unreachable writing") as info:
            wrapper(**_inputs())
    assert "the run itself had succeeded here" in str(info.value)
    assert wrapper.last_run is None and _ubatch_threads() == []
    with pytest.raises(dp.DPGroupError, match="could not be ended cleanly"):
        dp.dp_all_reduce(torch.ones(1), 1, 0)


def test_the_main_threads_failure_is_named_as_such_to_the_peers(
    one_rank_group: None, interrupt_signal: int
) -> None:
    main = threading.main_thread().ident
    announced: list[str] = []

    def injector(p: Any) -> None:
        if (p.ubatch_id, p.index, p.where) == (1, 0, "launch") and not announced:
            ctx = current_ubatch_context()
            sync = ctx.run.sync
            signal.pthread_kill(main, interrupt_signal)
            deadline = time.monotonic() + 10
            while (msg := sync.peer_failure()) is None and time.monotonic() < deadline:
                time.sleep(0.005)
            announced.append(msg)

    wrapper = UBatchWrapper(Toy(layers=2), _dp_config(), CUDAGraphMode.NONE, "cpu")
    set_fault_injector(injector)
    try:
        with override_forward_context(_dp_context()):
            with pytest.raises(Interrupted):
                wrapper(**_inputs())
    finally:
        set_fault_injector(None)
    assert announced and announced[0].startswith(
        "DP rank 0 main thread (waiting for its micro-batches) failed: Interrupted"
    ), announced
    assert _ubatch_threads() == []
    # The group was drained, not broken: the next run works.
    with override_forward_context(_dp_context()):
        assert torch.equal(wrapper(**_inputs()), Toy(layers=2)(**_inputs()))
