"""What the security tests share: a worker that also allow-lists :mod:`security_probe`
(this directory on its PYTHONPATH), as the fixture ``w`` (one per test module: import it
into the module, ``from security_support import w``), and the assertion that a request
was refused."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import WorkerCallError, WorkerProc, spawn_worker

P = "security_probe"
D = "vllm_bridge.bridge.diag"
FC = "vllm_bridge.forward_context"
ALLOW = [D, FC, P]


def spawn_probe_worker(env: dict[str, str] | None = None) -> WorkerProc:
    """A worker allowing :data:`ALLOW`, with this directory on its PYTHONPATH (and
    ``env`` set while it starts)."""
    return spawn_worker(["--allow", *ALLOW], support=True, env=env)


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
