"""What the tests of tensors in slots (ext 8, :mod:`vllm_bridge.bridge.protocol.slots`)
share: a slot directory of a small threshold as the fixture ``slots`` (import it into the
module: ``from slots_support import slots``), ext 8 values naming a slot, and a bounded
wait. The private directory itself is conftest.py's ``slot_root``.

The tests, by subject: test_protocol_slots.py (the directory, reading argument slots, a
worker serving them), test_protocol_slots_results.py (writing result slots, their reuse
and bounds), test_protocol_slots_expiry.py (idle slots deleted, lent ones kept, the
sweeper thread and its settings), test_protocol_slots_refused.py (a reply refused for
its size)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch

from vllm_bridge.bridge.protocol.slot_setup import open_slot_dir
from vllm_bridge.bridge.protocol.slots import SlotDir, slot_payload
from vllm_bridge.bridge.protocol.tensors import tensor_parts

MIN = 1024  # a small threshold, so that the tests move little data


@pytest.fixture
def slots(slot_root: Path) -> Iterator[SlotDir]:
    d = open_slot_dir(str(slot_root), min_bytes=MIN)
    assert d is not None
    d.sweep = False  # (these tests call expire() themselves)
    yield d
    d.close()


def ext8(t: torch.Tensor, name: str) -> bytes:
    header, _ = tensor_parts(t)
    return packb_ext(slot_payload(header, name))


def packb_ext(payload: bytes) -> bytes:
    return msgpack.packb(msgpack.ExtType(8, payload))


def put_arg(root: Path, name: str, data: bytes) -> None:
    (root / name).write_bytes(data)


def wait_for(cond, timeout_s: float) -> bool:
    """Polls ``cond`` until it holds or ``timeout_s`` passes (a bound, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()
