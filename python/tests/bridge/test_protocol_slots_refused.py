"""A reply whose tensors went into result slots but that the worker refuses for its size
(python/vllm_bridge/bridge/protocol/encoder.py, ``Encoder.encode``'s ``check``): its
slots go back at once (docs/PROTOCOL.md, "Tensors in slots (ext 8)", *Bounds*)."""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
from conftest import next_id, spawn_worker

from vllm_bridge.bridge.protocol import packb
from vllm_bridge.bridge.protocol.slots import MAX_RESULT_SLOTS, split_payload

MIN = 1024  # a small threshold, so that the test moves little data


def test_a_reply_refused_for_its_size_gives_its_result_slots_back(slot_root: Path):
    """A reply whose tensors went into result slots but whose frame is still over the
    frame limit is refused (an error reply names its size): its slots were never named
    to anybody, so they are free again at once. Were they left lent, the refused replies
    would lend every slot, and the next large result would take the pipe until the
    reclaim age."""
    wp = spawn_worker(
        ["--allow", "answer_support", "--max-frame-bytes", "65536"],
        support=True,
        env={"VLLM_BRIDGE_SHM_DIR": str(slot_root), "VLLM_BRIDGE_SHM_MIN_BYTES": str(MIN)},
    )
    logs = []
    try:

        def call(fn: str, args: list) -> list:
            rid = next_id()
            head = b"\x97" + packb("call") + packb(rid) + packb(None) + packb(30_000)
            wp.send_raw(head + packb(["m", "answer_support", fn]) + packb(args) + b"\x80")
            while (reply := msgpack.unpackb(wp.recv_raw(), raw=False))[0] == "log":
                logs.append(reply[3])  # (the worker's warning that every slot is lent)
            assert reply[1] == rid, reply
            return reply

        for _ in range(MAX_RESULT_SLOTS + 2):
            # Its 8 KiB tensor goes into a slot; the 70 000 bytes beside it do not fit.
            kind, _, err = call("tensor_and_bytes", [2048, 70_000])
            assert kind == "error" and "exceeds the frame limit" in err["message"], err
        kind, _, value = call("tensor_and_bytes", [2048, 10])
        assert kind == "ok" and value[0].code == 8, value  # a slot, not the pipe
        _, name = split_payload(value[0].data)
        assert (slot_root / name).stat().st_size == 2048 * 4
        lent = [n for n in os.listdir(slot_root) if n.startswith("r-") and "." not in n]
        assert lent == [name], lent  # nothing else is lent: the refused replies' slots
        assert logs == []
    finally:
        wp.stop()


def test_a_reply_whose_slots_are_over_the_frame_limit_is_refused(slot_root: Path):
    """The data of a reply's result slots counts toward the frame limit, as it would
    through the pipe: a reply whose frame is small but whose slot holds more than the
    limit is refused by its size (the Elixir side would refuse the slot too), and its
    slot goes back at once."""
    wp = spawn_worker(
        ["--allow", "answer_support", "--max-frame-bytes", "65536"],
        support=True,
        env={"VLLM_BRIDGE_SHM_DIR": str(slot_root), "VLLM_BRIDGE_SHM_MIN_BYTES": str(MIN)},
    )
    try:

        def call(numel: int) -> list:
            rid = next_id()
            head = b"\x97" + packb("call") + packb(rid) + packb(None) + packb(30_000)
            target = packb(["m", "answer_support", "tensor_and_bytes"])
            wp.send_raw(head + target + packb([numel, 10]) + b"\x80")
            while (reply := msgpack.unpackb(wp.recv_raw(), raw=False))[0] == "log":
                pass
            assert reply[1] == rid, reply
            return reply

        # 20 000 float32 elements: 80 000 bytes in a slot, a frame of a few dozen.
        kind, _, err = call(20_000)
        assert kind == "error", err
        assert "exceeds the frame limit of 65536 bytes" in err["message"], err
        # Within the limit: a slot, the refused reply's (given back at once, so nothing
        # else is lent).
        kind, _, value = call(10_000)
        assert kind == "ok" and value[0].code == 8, value
        _, name = split_payload(value[0].data)
        lent = [n for n in os.listdir(slot_root) if n.startswith("r-") and "." not in n]
        assert lent == [name], lent
    finally:
        wp.stop()
