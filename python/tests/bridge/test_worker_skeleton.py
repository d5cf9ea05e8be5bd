"""The smallest real path: a worker subprocess, its handshake, one call, exit on EOF."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from vllm_bridge import PROTOCOL_VERSION


def test_handshake_then_call(shared_worker):
    hello = shared_worker.hello
    assert hello["protocol"] == PROTOCOL_VERSION
    assert hello["pid"] == shared_worker.proc.pid
    assert hello["torch"] == torch.__version__
    assert hello["device"] == "cpu" or hello["device"].startswith("cuda:")

    shared_worker.send(["call", 1, None, 5000, ["m", "vllm_bridge.bridge.diag", "add"], [40, 2], {}])
    assert shared_worker.recv() == ["ok", 1, 42]


def test_call_outside_allow_list_is_refused(shared_worker):
    shared_worker.send(["call", 7, None, 5000, ["m", "os", "getcwd"], [], {}])
    kind, req_id, err = shared_worker.recv()
    assert (kind, req_id) == ("error", 7)
    assert "'os'" in err["message"]
    shared_worker.send(["call", 8, None, 5000, ["m", "vllm_bridge.bridge.diag", "add"], [1, 1], {}])
    assert shared_worker.recv() == ["ok", 8, 2]


def test_worker_exits_on_eof():
    from conftest import spawn_worker

    wp = spawn_worker()
    wp.close()
    # It exits, and cleanly; how fast is the machine's business (interpreter teardown with
    # torch loaded took over a second on a loaded CI machine).
    assert wp.proc.wait(timeout=30.0) == 0


def test_the_hello_names_the_device_calls_run_on(shared_worker):
    device = shared_worker.hello["device"]
    target = ["m", "vllm_bridge.bridge.diag", "default_device"]
    shared_worker.send(["call", 9, None, 5000, target, [], {}])
    assert shared_worker.recv() == ["ok", 9, device]


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: without it, nothing initialises CUDA"
)
def test_the_hello_does_not_initialise_cuda():
    """The handshake names the device without initialising CUDA (work that would delay
    it); the name is the one calls then run on."""
    code = (
        "import json, torch\n"
        "from vllm_bridge import PUBLIC_MODULES\n"
        "from vllm_bridge.bridge.worker import server\n"
        "mods = tuple(PUBLIC_MODULES)\n"
        "hello = server._hello('0' * 16, mods, server._import_allowed(mods))[1]\n"
        "initialised = torch.cuda.is_initialized()\n"
        "from vllm_bridge.bridge.diag import default_device\n"
        "print(json.dumps([hello['device'], initialised, default_device()]))\n"
    )
    out = subprocess.check_output([sys.executable, "-c", code])
    device, initialised, used = json.loads(out)
    assert (device, initialised) == (used, False)
