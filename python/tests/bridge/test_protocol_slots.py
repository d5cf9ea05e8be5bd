"""Tensors in slots (ext 8, vllm_bridge.bridge.protocol.slots), read: a frame names a
slot, never a path; a reader takes only its fixed-pattern names, relative to the
directory, never through a link, and only a regular file of its own uid of the tensor's
size; an argument slot is handed back by rename once its tensor is gone; a worker given a
directory reads argument slots and writes result slots, and answers a hostile slot with
bad_argument under the id. Writing result slots: test_protocol_slots_results.py; their
expiry and the sweeper: test_protocol_slots_expiry.py (what the three share:
slots_support.py)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import msgpack
import pytest
import torch
from conftest import next_id, spawn_worker
from slots_support import (  # noqa: F401 - slots is the fixture
    MIN,
    ext8,
    packb_ext,
    put_arg,
    slots,
    wait_for,
)

from vllm_bridge.bridge.protocol import BadArgument, packb
from vllm_bridge.bridge.protocol.decoder import Decoder
from vllm_bridge.bridge.protocol.slot_setup import open_slot_dir
from vllm_bridge.bridge.protocol.slots import SlotDir, slot_payload, split_payload
from vllm_bridge.bridge.protocol.tensors import tensor_parts


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
