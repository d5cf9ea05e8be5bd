"""What the tests of a DP group in this process share: a free local port, and the
worker's ``VLLM_DP_*`` environment cleared (the group destroyed after the test)."""

import socket
from collections.abc import Iterator

import pytest

from vllm_bridge import dp

DP_ENV = (
    "VLLM_DP_RANK",
    "VLLM_DP_SIZE",
    "VLLM_DP_MASTER_IP",
    "VLLM_DP_MASTER_PORT",
    "VLLM_DP_BACKEND",
    "VLLM_DP_TIMEOUT_S",
)


def free_port() -> int:
    """A TCP port free on loopback just now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The monkeypatch, with every ``VLLM_DP_*`` variable unset; the DP group this
    process joined, if any, destroyed at the end."""
    for name in DP_ENV:
        monkeypatch.delenv(name, raising=False)
    try:
        yield monkeypatch
    finally:
        dp.destroy_dp_group()
