"""Tensors in slots (ext 8, vllm_bridge.bridge.protocol.slots), written: a large result
goes into a result slot and a small one inline; slots are handed back by rename and
reused under a new name each time, bounded in number (the pipe past the bound), never
over a file a dead process left, replaced past the reclaim age, and given back when an
encode fails. Reading slots: test_protocol_slots.py; expiry: test_protocol_slots_expiry.py."""

from __future__ import annotations

import os
import re
from pathlib import Path

import msgpack
import pytest
import torch
from slots_support import slots  # noqa: F401 - the fixture

from vllm_bridge.bridge.protocol import unpackb
from vllm_bridge.bridge.protocol.encoder import Encoder
from vllm_bridge.bridge.protocol.registry import TypeRegistry
from vllm_bridge.bridge.protocol.slot_setup import open_slot_dir
from vllm_bridge.bridge.protocol.slots import SlotDir, split_payload


def test_a_large_result_goes_into_a_slot_a_small_one_inline(slots: SlotDir, slot_root: Path):
    enc = Encoder(TypeRegistry(()), slots=slots)
    small = torch.arange(10, dtype=torch.int32)
    assert unpackb(b"".join(enc.encode(small))).equal(small)
    big = torch.arange(1000, dtype=torch.float64)
    body = b"".join(enc.encode(big))
    ext = msgpack.unpackb(body)
    assert ext.code == 8
    _, name = split_payload(ext.data)
    assert re.fullmatch(rf"r-{os.getpid()}-0", name)
    assert (slot_root / name).read_bytes() == big.numpy().tobytes()


def test_result_slots_are_reused_once_handed_back_and_bounded(slots: SlotDir, slot_root: Path):
    data = memoryview(bytes(range(256)) * 8)
    names = [slots.write(data) for _ in range(slots.max_slots)]
    assert len(set(names)) == slots.max_slots
    assert slots.write(data) is None  # every slot lent: the pipe
    inode = os.stat(slot_root / names[2]).st_ino
    os.rename(slot_root / names[2], slot_root / (names[2] + ".free"))  # the reader is done
    # The same file again (its pages kept), under a new name: a name is lent once.
    again = slots.write(memoryview(b"x" * 100))
    assert again is not None and again not in names
    assert os.stat(slot_root / again).st_ino == inode
    assert (slot_root / again).read_bytes() == b"x" * 100
    assert not (slot_root / names[2]).exists() and not (slot_root / (names[2] + ".free")).exists()
    # So a late hand-back of the old name (the Elixir side's, for a caller that died)
    # finds nothing and cannot free the new lend.
    with pytest.raises(FileNotFoundError):
        os.rename(slot_root / names[2], slot_root / (names[2] + ".free"))
    assert (slot_root / again).exists()
    slots.give_back(names[0])  # its frame was not sent: nobody has its name
    assert slots.write(data) == names[0]
    slots.close()
    assert os.listdir(slot_root) == []


def test_a_slot_taken_back_never_replaces_a_file_a_dead_process_left(slot_root: Path):
    # A worker that died left r-<pid>-<n> files, and a new worker got the same os pid
    # (here: this process): the names it makes must pass over them, a new slot's file
    # and a handed-back slot's fresh name alike, leaving the old files as they were (a
    # caller may still hold a frame that names one).
    pid = os.getpid()
    stale = {n: slot_root / f"r-{pid}-{n}" for n in [0, 2, 3, 4, 5]}

    def plant(ns: list[int]) -> None:
        for n in ns:
            stale[n].write_bytes(b"OLD%d" % n * 8)

    plant([0])  # before the first slot's file is made
    slots = open_slot_dir(str(slot_root), min_bytes=1)
    try:
        first = slots.write(memoryview(b"A" * 32))
        assert first == f"r-{pid}-1"
        plant([2, 3, 4, 5])  # where the next fresh names would go
        inodes = {n: os.stat(p).st_ino for n, p in stale.items()}
        os.rename(slot_root / first, slot_root / (first + ".free"))  # read and handed back
        again = slots.write(memoryview(b"NEW!" * 8))
        assert again == f"r-{pid}-6"
        assert (slot_root / again).read_bytes() == b"NEW!" * 8
        for n, path in stale.items():
            assert path.read_bytes() == b"OLD%d" % n * 8 and os.stat(path).st_ino == inodes[n]
    finally:
        slots.close()


def test_a_slot_lent_past_the_reclaim_age_is_replaced_under_a_new_name(
    slots: SlotDir, slot_root: Path, caplog
):
    # A result slot whose frame nobody decodes (its caller died with the reply in its
    # mailbox) is never handed back. Past the reclaim age the worker drops it and makes
    # a new one: a new name and file, so a late reader finds the old one gone rather than
    # other data; before that age, results take the pipe, said once in the log.
    data = memoryview(bytes(range(256)) * 8)
    names = [slots.write(data) for _ in range(slots.max_slots)]
    with caplog.at_level("WARNING", logger="vllm_bridge.bridge.protocol.slots"):
        assert slots.write(data) is None
        assert slots.write(data) is None
    said = [r for r in caplog.records if "every result slot" in r.getMessage()]
    assert len(said) == 1, caplog.records
    slots.reclaim_after_s = 0.0
    fresh = slots.write(memoryview(b"z" * 300))
    assert fresh is not None and fresh not in names
    assert (slot_root / fresh).read_bytes() == b"z" * 300
    gone = [n for n in names if not (slot_root / n).exists()]
    assert len(gone) == 1, os.listdir(slot_root)
    assert len(os.listdir(slot_root)) == slots.max_slots


def test_a_failed_encode_gives_its_slots_back(slots: SlotDir):
    enc = Encoder(TypeRegistry(()), slots=slots)
    big = torch.zeros(1000)
    with pytest.raises(TypeError):
        enc.encode([big, object()])  # no session to hold a reference to the object
    names = {slots.write(memoryview(b"y" * 2000)) for _ in range(slots.max_slots)}
    assert None not in names
