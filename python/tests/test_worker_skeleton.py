"""The smallest real path: a worker subprocess, its handshake, one call, exit on EOF."""

from __future__ import annotations

import torch

from vllm_bridge import PROTOCOL_VERSION


def test_handshake_then_call(shared_worker):
    hello = shared_worker.hello
    assert hello["protocol"] == PROTOCOL_VERSION
    assert hello["pid"] == shared_worker.proc.pid
    assert hello["torch"] == torch.__version__
    assert hello["device"] == "cpu" or hello["device"].startswith("cuda:")

    shared_worker.send(["call", 1, None, 5000, ["m", "vllm_bridge.diag", "add"], [40, 2], {}])
    assert shared_worker.recv() == ["ok", 1, 42]


def test_call_outside_allow_list_is_refused(shared_worker):
    shared_worker.send(["call", 7, None, 5000, ["m", "os", "getcwd"], [], {}])
    kind, req_id, err = shared_worker.recv()
    assert (kind, req_id) == ("error", 7)
    assert "'os'" in err["message"]
    shared_worker.send(["call", 8, None, 5000, ["m", "vllm_bridge.diag", "add"], [1, 1], {}])
    assert shared_worker.recv() == ["ok", 8, 2]


def test_worker_exits_on_eof():
    from conftest import spawn_worker

    wp = spawn_worker()
    wp.close()
    assert wp.proc.wait(timeout=1.0) == 0
