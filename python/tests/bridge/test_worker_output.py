"""The worker's logs and output (docs/PROTOCOL.md, "Output"): ``--log-level`` sets the
root logger's level and the least a record needs to become a ``log`` frame; stdout is line
buffered, so a print reaches the reader of fd 1 when its line ends (the Elixir side reads
fds 1 and 2 line by line); a pong reports the running request's age and CUDA memory.

Real worker processes over real pipes (conftest.spawn_worker), with fd 1 a pipe read here.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
from pathlib import Path

import pytest
import torch

from tests.bridge.conftest import next_id, spawn_worker
from vllm_bridge.bridge.worker.server import LOG_LEVELS, parse_args

D = "vllm_bridge.bridge.diag"
#: test/support, where rt_output lives (shared with the Elixir runtime tests).
SUPPORT = str(Path(__file__).resolve().parents[3] / "test" / "support")


def _support_env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [SUPPORT, os.environ.get("PYTHONPATH")]))}


@pytest.mark.parametrize("level", ["debug", "info", "warning", "error"])
def test_log_level_forwards_records_at_or_above_it(level):
    w = spawn_worker(["--log-level", level])
    try:
        for name in ("debug", "info", "warning", "error"):
            w.call(D, "log", f"at {name}", level=name)
        w.ping()  # every log frame of the calls above came before this reply
        sent = [msg[3] for msg in w.logs]
        expected = [f"at {n}" for n in LOG_LEVELS if LOG_LEVELS[n] >= LOG_LEVELS[level]]
        assert sent == expected
    finally:
        w.stop()


def test_log_level_is_the_root_level_and_a_bad_one_is_refused(capsys):
    assert parse_args([]).log_level == "warning"
    assert parse_args(["--log-level", "debug"]).log_level == "debug"
    with pytest.raises(SystemExit):
        parse_args(["--log-level", "verbose"])
    assert "'verbose'" in capsys.readouterr().err
    assert LOG_LEVELS["debug"] == logging.DEBUG


def test_a_logger_of_its_own_lower_level_is_still_held_to_the_pools_level():
    # A library that sets its own logger to DEBUG still hands its records to the root's
    # handlers: the log frame handler's own level keeps them out.
    w = spawn_worker(["--also-allow", "rt_output"], env=_support_env())
    try:
        w.call("rt_output", "log", "chatty", "debug", "quiet", "debug")
        w.call("rt_output", "log", "chatty", "warning", "loud", "debug")
        assert [m for m in w.logs if m[2] == "chatty"] == [["log", "warning", "chatty", "loud"]]
    finally:
        w.stop()


def _read_until(fd: int, needle: bytes, timeout: float = 30.0) -> bytes:
    data = b""
    while needle not in data:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            raise TimeoutError(f"{needle!r} did not come within {timeout} s; got {data!r}")
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    return data


def test_a_print_reaches_fd_1_when_its_line_ends():
    # fd 1 is a pipe, not a terminal: without line buffering a print would wait in
    # Python's buffer until 8 KiB or the exit.
    w = spawn_worker(["--also-allow", "rt_output"], stdout=subprocess.PIPE, env=_support_env())
    try:
        w.call("rt_output", "say", "a line of its own")
        assert b"a line of its own\n" in _read_until(w.proc.stdout.fileno(), b"own\n")
    finally:
        w.stop()


def test_pong_reports_the_running_request_and_its_age():
    w = spawn_worker()
    try:
        call_id = next_id()
        w.send(["call", call_id, None, 60_000, ["m", D, "sleep"], [0.5], {}])
        ages = []
        while True:
            status = w.ping()
            if status["running"] == call_id:
                ages.append(status["running_for"])
            elif ages:
                break  # it ended
        # Its age grows while it runs (at least two looks: a 0.5 s sleep, pings answered
        # within about 50 ms while it runs).
        assert len(ages) >= 2
        assert ages == sorted(ages) and ages[-1] > ages[0] >= 0
        assert w.reply(call_id)[0] == "ok"
        assert w.ping()["running_for"] is None
    finally:
        w.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pong_reports_cuda_memory_once_cuda_is_in_use():
    w = spawn_worker()
    try:
        assert w.ping()["cuda"] is None
        back = w.call(D, "to_device", torch.ones(1024, 1024), "cuda")
        assert torch.equal(back, torch.ones(1024, 1024))
        cuda = w.ping()["cuda"]
        assert set(cuda) == {"allocated", "reserved"}
        # The caching allocator keeps the block the tensor had (4 MiB) reserved.
        assert cuda["reserved"] >= 4 * 1024 * 1024
        assert 0 <= cuda["allocated"] <= cuda["reserved"]
    finally:
        w.stop()
