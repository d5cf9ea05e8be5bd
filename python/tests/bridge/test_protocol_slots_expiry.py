"""Tensors in slots (ext 8, vllm_bridge.bridge.protocol.slots), expired: a result slot
handed back and idle is deleted, a lent one kept however long lent; the sweeper thread
does it by itself, ends when no slot is left and starts again with the next one (also
after it died); a busy worker's slot, reused within the idle age, never expires; bad ages
in the environment are said and the defaults used. Reading
slots: test_protocol_slots.py; writing them: test_protocol_slots_results.py."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from slots_support import MIN, slots, wait_for  # noqa: F401 - slots: the fixture

from vllm_bridge.bridge.protocol.slot_setup import open_slot_dir, slot_dir_from_env
from vllm_bridge.bridge.protocol.slots import IDLE_AFTER_S, RECLAIM_AFTER_S, SlotDir


def test_idle_result_slots_are_deleted_lent_ones_kept_however_long_lent(
    slots: SlotDir, slot_root: Path
):
    # (expire() is given the time: no waiting, no timing.)
    data = memoryview(bytes(range(256)) * 8)
    handed, given, lent = slots.write(data), slots.write(data), slots.write(data)
    os.rename(slot_root / handed, slot_root / (handed + ".free"))  # its reader is done
    slots.give_back(given)  # its frame was not sent
    soon = time.monotonic() + slots.idle_after_s / 2
    assert slots.expire(soon) == []
    later = time.monotonic() + slots.idle_after_s
    assert sorted(slots.expire(later)) == sorted([handed, given])
    # The lent one may still be read (a stream chunk its consumer pulls late): the sweep
    # never deletes it, however long it was lent; only a write that needs a slot when
    # every one is lent reclaims it (test_protocol_slots_results.py,
    # test_a_slot_lent_past_the_reclaim_age_...).
    for age in (slots.reclaim_after_s, 10 * slots.reclaim_after_s):
        assert slots.expire(time.monotonic() + age) == []
        assert os.listdir(slot_root) == [lent]
    assert (slot_root / lent).read_bytes() == bytes(data)
    # Handed back at last: idle from when it was written, deleted at the next sweep.
    os.rename(slot_root / lent, slot_root / (lent + ".free"))
    assert slots.expire(time.monotonic() + slots.idle_after_s) == [lent]
    assert os.listdir(slot_root) == []
    # Names are never used again: a late reader finds its slot gone, not other data.
    fresh = slots.write(data)
    assert fresh not in (handed, given, lent)


def test_the_sweeper_leaves_a_lent_slot_past_the_reclaim_age(slot_root: Path):
    # The thread itself, with ages short enough to pass many times over while it runs.
    d = open_slot_dir(str(slot_root), min_bytes=MIN, reclaim_after_s=0.05, idle_after_s=0.05)
    assert d is not None
    try:
        lent = d.write(memoryview(b"s" * 2000))
        other = d.write(memoryview(b"t" * 2000))
        os.rename(slot_root / other, slot_root / (other + ".free"))
        # The free one goes: the sweeper ran, past both ages, and left the lent one.
        assert wait_for(lambda: os.listdir(slot_root) == [lent], 15.0), os.listdir(slot_root)
        time.sleep(0.3)  # (several more sweeps)
        assert os.listdir(slot_root) == [lent]
        assert (slot_root / lent).read_bytes() == b"s" * 2000
    finally:
        d.close()
    assert os.listdir(slot_root) == []


@pytest.mark.parametrize("which", ["RECLAIM", "IDLE"])
@pytest.mark.parametrize("value", ["soon", "-1", "0", "nan", "inf", "86400.5", "2e10", "1e308"])
def test_bad_ages_in_the_environment_are_said_and_the_defaults_used(
    slot_root: Path, monkeypatch, caplog, value: str, which: str
):
    # Too large is bad too: an idle age of 2e10 s made the sweeper's timed wait overflow
    # the platform's timers, and the thread died with the sweep never started again.
    good = {"RECLAIM": "7", "IDLE": "0.5"}
    monkeypatch.setenv("VLLM_BRIDGE_SHM_DIR", str(slot_root))
    for name, v in good.items():
        monkeypatch.setenv(f"VLLM_BRIDGE_SHM_{name}_S", value if name == which else v)
    with caplog.at_level("WARNING", logger="vllm_bridge.bridge.protocol.slots"):
        d = slot_dir_from_env()
    assert d is not None
    try:
        ages = {"RECLAIM": d.reclaim_after_s, "IDLE": d.idle_after_s}
        defaults = {"RECLAIM": RECLAIM_AFTER_S, "IDLE": IDLE_AFTER_S}
        for name in good:
            assert ages[name] == (defaults[name] if name == which else float(good[name]))
        said = [r.getMessage() for r in caplog.records]
        var = f"VLLM_BRIDGE_SHM_{which}_S"
        assert any(var in m and repr(value) in m for m in said), said
    finally:
        d.close()


def test_a_sweeper_that_dies_is_started_again_with_the_next_slot(slot_root: Path, monkeypatch):
    d = open_slot_dir(str(slot_root), min_bytes=MIN, idle_after_s=0.05)
    assert d is not None
    calls: list = []
    died: list = []

    def failing_expire(now=None):
        calls.append(now)
        raise RuntimeError("sweep failed")

    try:
        monkeypatch.setattr(d, "expire", failing_expire)
        monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
        d.write(memoryview(b"a" * 100))
        assert wait_for(lambda: died and d._sweeper is None, 10.0), (calls, died, d._sweeper)
        assert isinstance(died[0], RuntimeError)
        monkeypatch.undo()  # the real expire from here on
        d.write(memoryview(b"b" * 100))
        assert d._sweeper is not None and d._sweeper.is_alive()
    finally:
        d.close()


def test_a_busy_workers_result_slot_is_reused_not_expired(slots: SlotDir, slot_root: Path):
    data = memoryview(bytes(range(256)) * 8)
    name = slots.write(data)
    inode = os.stat(slot_root / name).st_ino
    seen = {name}
    for _ in range(20):
        os.rename(slot_root / name, slot_root / (name + ".free"))
        # Each write within the idle period of the one before: nothing expires.
        assert slots.expire(time.monotonic() + slots.idle_after_s / 2) == []
        name = slots.write(data)
        # The same file each time, under a name never lent before.
        assert name not in seen and os.listdir(slot_root) == [name]
        assert os.stat(slot_root / name).st_ino == inode
        seen.add(name)


def test_the_sweeper_deletes_idle_slots_then_ends(slot_root: Path):
    d = open_slot_dir(str(slot_root), min_bytes=MIN)
    assert d is not None
    d.idle_after_s = 0.2
    try:
        name = d.write(memoryview(b"q" * 2000))
        sweeper = d._sweeper
        assert sweeper is not None and sweeper.is_alive()
        os.rename(slot_root / name, slot_root / (name + ".free"))
        assert wait_for(lambda: os.listdir(slot_root) == [], 15.0), os.listdir(slot_root)
        sweeper.join(15.0)
        assert not sweeper.is_alive() and d._sweeper is None  # no slots: no thread
        again = d.write(memoryview(b"r" * 2000))
        assert again != name and d._sweeper is not None and d._sweeper.is_alive()
    finally:
        d.close()
    assert os.listdir(slot_root) == []
