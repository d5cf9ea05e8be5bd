"""Tensors in slots (ext 8, vllm_bridge.bridge.protocol.slots): a frame names a slot,
never a path; a reader takes only its fixed-pattern names, relative to the directory,
never through a link, and only a regular file of its own uid of the tensor's size; slots
are handed back by rename and reused; a worker given a directory reads argument slots
and writes result slots, and answers a hostile slot with bad_argument under the id."""

from __future__ import annotations

import gc
import os
import re
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
from conftest import next_id, spawn_worker

from vllm_bridge.bridge.protocol import BadArgument, packb, unpackb
from vllm_bridge.bridge.protocol.decoder import Decoder
from vllm_bridge.bridge.protocol.encoder import Encoder
from vllm_bridge.bridge.protocol.registry import TypeRegistry
from vllm_bridge.bridge.protocol.slot_setup import open_slot_dir, slot_dir_from_env
from vllm_bridge.bridge.protocol.slots import (
    IDLE_AFTER_S,
    RECLAIM_AFTER_S,
    SlotDir,
    slot_payload,
    split_payload,
)
from vllm_bridge.bridge.protocol.tensors import tensor_parts

MIN = 1024  # a small threshold, so that the tests move little data


@pytest.fixture
def slots(slot_root: Path):
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


# -- the directory ------------------------------------------------------------------------


def test_no_directory_without_a_private_dir_of_ours(tmp_path: Path):
    assert open_slot_dir(None) is None
    assert open_slot_dir("") is None
    assert open_slot_dir(str(tmp_path / "absent")) is None
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    assert open_slot_dir(str(loose)) is None  # others may read or plant files there
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    assert open_slot_dir(str(tmp_path / "link")) is None


# -- reading argument slots ----------------------------------------------------------------


def test_an_argument_slot_is_held_while_its_tensor_lives_then_handed_back(
    slots: SlotDir, slot_root: Path
):
    t = torch.arange(600, dtype=torch.float32)
    put_arg(slot_root, "e-5", t.numpy().tobytes())
    got = Decoder(slots).decode(ext8(t, "e-5")).value
    assert torch.equal(got, t)
    assert os.listdir(slot_root) == [f"e-5.held-{os.getpid()}"]
    # The mapping is private: writing to the tensor never changes the slot.
    got[0] = -1.0
    assert (slot_root / f"e-5.held-{os.getpid()}").read_bytes() == t.numpy().tobytes()
    view = got[10:20]
    del got
    gc.collect()
    assert os.listdir(slot_root) == [f"e-5.held-{os.getpid()}"]  # a view keeps it
    assert torch.equal(view, t[10:20])
    del view
    gc.collect()
    assert os.listdir(slot_root) == ["e-5.free"]


@pytest.mark.parametrize(
    "name",
    ["../x", "/etc/passwd", "e-1/../../x", "r-1-1", "x", "e-", "e-1.free", "e-1\x00", "E-1", ""],
)
def test_a_name_of_another_pattern_is_refused(slots: SlotDir, slot_root: Path, name: str):
    (slot_root.parent / "x").write_bytes(b"\0" * 4)
    with pytest.raises(BadArgument, match="not the name of an argument slot"):
        slots.read(name, 4)
    assert os.path.exists(slot_root.parent / "x")


def test_a_link_planted_in_the_directory_is_refused(slots: SlotDir, slot_root: Path, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 16)
    (slot_root / "e-3").symlink_to(secret)
    with pytest.raises(BadArgument, match="'e-3' cannot be opened"):
        slots.read("e-3", 16)


def test_a_file_of_the_wrong_size_is_refused(slots: SlotDir, slot_root: Path):
    put_arg(slot_root, "e-4", b"\0" * 15)
    with pytest.raises(BadArgument, match="holds 15 bytes, the tensor needs 16"):
        slots.read("e-4", 16)


def test_a_directory_a_fifo_or_a_missing_slot_is_refused(slots: SlotDir, slot_root: Path):
    (slot_root / "e-6").mkdir()
    with pytest.raises(BadArgument, match="'e-6' is not a regular file"):
        slots.read("e-6", 16)
    os.mkfifo(slot_root / "e-8")  # (an open that waited for a writer would hang here)
    with pytest.raises(BadArgument, match="'e-8' is not a regular file"):
        slots.read("e-8", 16)
    with pytest.raises(BadArgument, match="'e-7' is gone"):
        slots.read("e-7", 16)


def test_a_decoder_without_a_directory_refuses_ext_8():
    with pytest.raises(BadArgument, match="no slot directory"):
        Decoder().decode(ext8(torch.zeros(4), "e-1"))


def test_malformed_payloads_are_refused(slots: SlotDir):
    header, _ = tensor_parts(torch.zeros(4))
    for payload in [b"", b"\x08", header, header + b"\x05e-1", header + b"\x03e-\xff"]:
        with pytest.raises(BadArgument):
            Decoder(slots).decode(packb_ext(payload))


def test_split_payload_gives_header_and_name():
    header, _ = tensor_parts(torch.zeros(2, 3, dtype=torch.int64))
    assert split_payload(slot_payload(header, "e-12")) == (header, "e-12")


# -- writing result slots ------------------------------------------------------------------


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
    # every one is lent reclaims it (test_a_slot_lent_past_the_reclaim_age_...).
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


def wait_for(cond, timeout_s: float) -> bool:
    """Polls ``cond`` until it holds or ``timeout_s`` passes (a bound, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


# -- a worker -----------------------------------------------------------------------------


def test_a_worker_reads_argument_slots_and_answers_hostile_ones(slot_root: Path, tmp_path):
    wp = spawn_worker(
        env={"VLLM_BRIDGE_SHM_DIR": str(slot_root), "VLLM_BRIDGE_SHM_MIN_BYTES": str(MIN)}
    )
    try:
        target = packb(["m", "vllm_bridge.bridge.diag", "echo"])

        def call(arg: bytes) -> list:
            rid = next_id()
            head = b"\x97" + packb("call") + packb(rid) + packb(None) + packb(30_000)
            wp.send_raw(head + target + b"\x91" + arg + b"\x80")
            reply = msgpack.unpackb(wp.recv_raw(), raw=False, strict_map_key=False)
            assert reply[1] == rid
            return reply

        t = torch.arange(2048, dtype=torch.float32)
        put_arg(slot_root, "e-0", t.numpy().tobytes())
        kind, _, value = call(ext8(t, "e-0"))
        assert kind == "ok" and value.code == 8  # echoed into a result slot of its own
        _, name = split_payload(value.data)
        assert name == f"r-{wp.proc.pid}-0"
        assert (slot_root / name).read_bytes() == t.numpy().tobytes()
        assert (slot_root / "e-0.free").exists() or (slot_root / f"e-0.held-{wp.proc.pid}").exists()

        (tmp_path / "secret").write_bytes(b"\0" * t.nbytes)
        (slot_root / "e-9").symlink_to(tmp_path / "secret")
        put_arg(slot_root, "e-8", b"\0" * 12)
        for bad, why in [
            ("../secret", "not the name of an argument slot"),
            (str(tmp_path / "secret"), "not the name of an argument slot"),
            (name, "not the name of an argument slot"),  # a result slot: not for it to read
            ("e-9", "cannot be opened"),
            ("e-8", "holds 12 bytes"),
        ]:
            kind, _, err = call(ext8(t, bad))
            assert (kind, err["type"]) == ("error", "bad_argument"), bad
            assert why in err["message"], err["message"]
        assert call(packb(7))[0] == "ok"  # it serves on

        # Its result slot, handed back and unused, goes (IDLE_AFTER_S; a bounded wait).
        os.rename(slot_root / name, slot_root / (name + ".free"))
        assert wait_for(
            lambda: not any(n.startswith("r-") for n in os.listdir(slot_root)), 60.0
        ), os.listdir(slot_root)
    finally:
        wp.stop()
    assert not any(n.startswith("r-") for n in os.listdir(slot_root))  # deleted on exit

