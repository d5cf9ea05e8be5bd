"""What the security tests share: a worker that also allow-lists :mod:`security_probe`
(this directory on its PYTHONPATH), as the fixture ``w`` (one per test module: import it
into the module, ``from security_support import w``), and the assertion that a request
was refused."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import WorkerCallError, WorkerProc, spawn_worker

HERE = Path(__file__).resolve().parent
P = "security_probe"
D = "vllm_bridge.bridge.diag"
FC = "vllm_bridge.forward_context"
ALLOW = [D, FC, P]


def spawn_probe_worker(env: dict[str, str] | None = None) -> WorkerProc:
    """A worker allowing :data:`ALLOW`, with this directory on its PYTHONPATH (and
    ``env`` set while it starts)."""
    saved = {k: os.environ.get(k) for k in ["PYTHONPATH", *(env or {})]}
    paths = [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    os.environ.update({"PYTHONPATH": os.pathsep.join(paths), **(env or {})})
    try:
        return spawn_worker(["--allow", *ALLOW])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def refused(attempt: Callable[[], Any]) -> str:
    """Run ``attempt``; it must fail with ``bad_argument``. Returns the message."""
    with pytest.raises(WorkerCallError) as err:
        attempt()
    error = err.value.error
    assert error["type"] == "bad_argument", error
    return error["message"]


@pytest.fixture(scope="module")
def w() -> Iterator[WorkerProc]:
    """A worker allowing :data:`ALLOW`, shared by the tests of one module (they must
    leave it serving)."""
    wp = spawn_probe_worker()
    try:
        yield wp
    finally:
        wp.stop()
