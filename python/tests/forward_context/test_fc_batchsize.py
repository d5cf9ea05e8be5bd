"""Batch-size tracking under set_forward_context: recording, stats, logging, the switch."""

import importlib
import logging
import time
from collections.abc import Iterator

import pytest
import torch

from vllm_bridge import batchsize
from vllm_bridge import forward_context as fc
from vllm_bridge.config import VllmConfig


@pytest.fixture
def tracking() -> Iterator[None]:
    fc.reset_batchsize_stats()
    fc.configure_batchsize_tracking(0.0)
    try:
        yield
    finally:
        fc.configure_batchsize_tracking(-1)
        fc.reset_batchsize_stats()


def _forward(num_tokens: int | None, attn_metadata: object = "meta") -> None:
    with fc.set_forward_context(attn_metadata, VllmConfig(), num_tokens=num_tokens):
        pass


def test_off_records_nothing() -> None:
    fc.reset_batchsize_stats()
    fc.configure_batchsize_tracking(-1)
    assert fc.track_batchsize is False
    _forward(8)
    assert dict(fc.batchsize_forward_time) == {}


def test_records_per_batch_size_and_reports_medians_by_count(tracking: None) -> None:
    assert fc.track_batchsize is True and fc.batchsize_logging_interval == 0.0
    before = time.perf_counter()
    for size in (8, 8, 8, 16, 16, 32):
        _forward(size)
    _forward(64, attn_metadata=None)  # passes without attention metadata are not timed
    times = fc.batchsize_forward_time
    assert {k: len(v) for k, v in times.items()} == {8: 3, 16: 2, 32: 1}
    assert all(t >= 0 for v in times.values() for t in v)
    assert fc.forward_start_time >= before
    stats = fc.get_batchsize_stats()
    assert [(size, count) for size, count, _ in stats] == [(8, 3), (16, 2)]
    assert stats[0][2] == round(sorted(times[8])[1], 2)  # the median of three
    assert [s[0] for s in fc.get_batchsize_stats(min_count=1)] == [8, 16, 32]
    with pytest.raises(ValueError, match="min_count must be >= 1, got 0"):
        fc.get_batchsize_stats(min_count=0)


def test_stats_are_logged_at_the_interval(
    tracking: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vllm_bridge.forward_context")
    _forward(4)  # one sample: nothing worth logging yet
    assert caplog.records == []
    _forward(4)
    assert len(caplog.records) == 1
    assert "(batchsize, count, median_time(ms))" in caplog.records[0].getMessage()
    assert "(4, 2, " in caplog.records[0].getMessage()
    assert fc.last_logging_time > 0
    # A long interval: no more log lines, but passes are still recorded.
    fc.configure_batchsize_tracking(3600)
    batchsize.last_logging_time = time.perf_counter()
    _forward(4)
    assert len(caplog.records) == 1
    assert len(fc.batchsize_forward_time[4]) == 3


def test_a_failing_pass_is_still_timed(tracking: None) -> None:
    with pytest.raises(RuntimeError):
        with fc.set_forward_context("meta", VllmConfig(), num_tokens=2):
            raise RuntimeError("model failed")
    assert len(fc.batchsize_forward_time[2]) == 1


def test_configure_refuses_non_numbers() -> None:
    with pytest.raises(TypeError, match="interval_s must be a number of seconds, got 'often'"):
        fc.configure_batchsize_tracking("often")  # type: ignore[arg-type]


def test_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv("VLLM_LOG_BATCHSIZE_INTERVAL", "2.5")
        importlib.reload(batchsize)
        assert (fc.track_batchsize, fc.batchsize_logging_interval) == (True, 2.5)
        monkeypatch.setenv("VLLM_LOG_BATCHSIZE_INTERVAL", "0")
        importlib.reload(batchsize)
        assert fc.track_batchsize is True
        monkeypatch.setenv("VLLM_LOG_BATCHSIZE_INTERVAL", "sometimes")
        with pytest.raises(ValueError, match="VLLM_LOG_BATCHSIZE_INTERVAL must be a number"):
            importlib.reload(batchsize)
        monkeypatch.delenv("VLLM_LOG_BATCHSIZE_INTERVAL")
        importlib.reload(batchsize)
        assert (fc.track_batchsize, fc.batchsize_logging_interval) == (False, -1.0)
    finally:
        monkeypatch.delenv("VLLM_LOG_BATCHSIZE_INTERVAL", raising=False)
        importlib.reload(batchsize)


def test_a_tracked_pass_waits_for_the_device_before_it_stops_the_clock(
    tracking: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The platform's synchronize runs once per tracked pass, before the time is taken.
    (On this CPU host the platform has no synchronize: a recording one stands in for the
    GPU's; the CUDA test below runs the real one.)"""
    from vllm_bridge.platforms import Platform

    events: list[str] = []

    def synchronize() -> None:
        events.append("sync")

    monkeypatch.setattr(batchsize, "current_platform", Platform("test", synchronize))
    real_perf_counter = time.perf_counter

    def perf_counter() -> float:
        events.append("clock")
        return real_perf_counter()

    monkeypatch.setattr(batchsize.time, "perf_counter", perf_counter)
    _forward(8)
    assert events == ["clock", "sync", "clock"]  # begin, then sync before the end time
    _forward(8, attn_metadata=None)  # not tracked: no sync
    assert events == ["clock", "sync", "clock"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_tracked_pass_ends_with_the_device_idle(tracking: None) -> None:
    torch.cuda.synchronize()
    with fc.set_forward_context("meta", VllmConfig(), num_tokens=8):
        torch.cuda._sleep(200_000_000)  # a kernel that keeps the GPU busy ~0.1 s
        assert not torch.cuda.current_stream().query()  # still running in the body
    assert torch.cuda.current_stream().query()  # the exit waited for it
    assert len(fc.batchsize_forward_time[8]) == 1


def test_configure_refuses_what_is_not_a_number_of_seconds() -> None:
    for bad, exc in (("1", TypeError), (True, TypeError), (None, TypeError), (float("nan"), ValueError)):
        with pytest.raises(exc, match="interval_s must be a number of seconds"):
            fc.configure_batchsize_tracking(bad)
