"""The encoder refuses extension values it did not make (protocol/foreign.py): msgpack packs
a ``msgpack.ExtType`` (and a ``msgpack.Timestamp``) by itself, never asking the encoder,
so a value holding one would reach the peer as one of the protocol's own values (a
reference, a tensor in a result slot, ...). Generated values hold one of every code at
generated places (lists, tuples, dict keys and values, dataclass fields, depths 0-5):
each is refused, naming where it sits; the same values with plain bytes in its place
encode byte for byte as the encoder does without the check, as do the encoder's own
exts (atoms, tuples, tensors inline, spliced and in slots, big integers, dataclasses).
The worker's replies: test_worker_foreign.py."""

from __future__ import annotations

import random
from pathlib import Path

import msgpack
import pytest
import torch
from foreign_support import CODES, Box, forged, nest, pair, sibling
from slots_support import slots  # noqa: F401 - the fixture

from vllm_bridge.bridge.protocol import Atom, Encoder, TypeRegistry, unpackb
from vllm_bridge.bridge.protocol import encoder as encoder_module
from vllm_bridge.bridge.protocol import foreign
from vllm_bridge.bridge.protocol.foreign import ForeignValue
from vllm_bridge.bridge.protocol.slot_setup import open_slot_dir

REGISTRY = TypeRegistry(("foreign_support",))


def unchecked(monkeypatch: pytest.MonkeyPatch, encoder: Encoder, value: object) -> bytes:
    """``value`` encoded as the encoder does without looking for foreign exts."""
    with monkeypatch.context() as m:
        m.setattr(encoder_module, "holds_foreign", lambda data, made, value: False)
        return b"".join(bytes(s) for s in encoder.encode(value))


def encoded(encoder: Encoder, value: object) -> bytes:
    return b"".join(bytes(s) for s in encoder.encode(value))


def refused(encoder: Encoder, value: object, path: str) -> str:
    with pytest.raises(ForeignValue) as info:
        encoder.encode(value)
    message = str(info.value)
    at = f"the value encoded (at {path}) is " if path else "the value encoded is "
    assert message.startswith(at), (message, path)
    return message


@pytest.mark.parametrize("code", CODES)
def test_an_ext_of_any_code_anywhere_is_refused_and_plain_bytes_there_encode_as_before(
    code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    enc = Encoder(REGISTRY)
    for seed in range(6):
        bad, good, path = pair(code * 100 + seed, code, depth=seed)
        message = refused(enc, bad, path)
        assert f"a msgpack.ExtType (code {code}, 9 bytes of data)" in message
        assert f"as ext {code}" in message
        assert encoded(enc, good) == unchecked(monkeypatch, enc, good)
    # The encoder serves on: a pass that failed leaves nothing behind.
    assert unpackb(encoded(enc, [1, Atom("a"), (2,)])) == [1, Atom("a"), (2,)]


def test_what_each_of_the_protocols_own_codes_would_be_read_as_is_named() -> None:
    enc = Encoder(REGISTRY)
    for code, name in [(6, "an object reference"), (8, "a tensor in a result slot"),
                       (1, "an atom"), (7, "a big integer"), (3, "a tensor")]:  # fmt: skip
        message = refused(enc, [forged(code)], "[0]")
        assert f"which the peer would read as {name} of the protocol's" in message
    assert "which is not in the protocol's table" in refused(enc, forged(42), "")


def test_a_subclass_of_ext_type_is_refused_by_its_class() -> None:
    class Mine(msgpack.ExtType):
        pass

    message = refused(Encoder(REGISTRY), {"a": [Box(Mine(6, b"x"))]}, "['a'][0].item")
    assert ".Mine (code 6, 1 bytes of data)" in message


@pytest.mark.parametrize(
    "ext",
    [
        msgpack.Timestamp(1, 0),
        forged(-1, b"\x00\x00\x00\x01"),  # what msgpack reads as a timestamp
        forged(-1, bytes(8)),
        forged(-1, bytes(12)),
        forged(-1, b"abc"),  # what it cannot read at all
    ],
)
def test_ext_minus_one_in_every_form_is_refused(ext: object) -> None:
    enc = Encoder(REGISTRY)
    for seed in range(6):
        bad, path = nest(random.Random(seed), ext, seed)
        refused(enc, bad, path)


def test_refused_on_each_way_of_looking(monkeypatch: pytest.MonkeyPatch) -> None:
    # A level of a few values and many bytes is walked; of many values, or holding a
    # list or dict subclass (the encoder packs a copy of it), its bytes are read back; a
    # short level's bytes are read back at once.
    class Items(list):
        pass

    class Table(dict):
        pass

    enc = Encoder(REGISTRY)
    big = bytes(range(256)) * 8
    for value, path in [
        ([big, forged(6)], "[1]"),
        ([big, {"k": [forged(8)]}], "[1]['k'][0]"),
        (list(range(200)) + [forged(6)], "[200]"),
        ([big, Items([1, forged(6)])], "[1][1]"),
        (Table(a=Table(b=forged(8)), pad=big), "['a']['b']"),
        ([forged(6)], "[0]"),
        ({"k": forged(0, b"")}, "['k']"),
    ]:
        refused(enc, value, path)
    assert foreign.WALK_MIN_BYTES < len(big) and foreign.WALK_BUDGET < 200


def test_the_bytes_of_an_ext_header_inside_other_values_are_not_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    enc = Encoder(REGISTRY)
    rng = random.Random(7)
    values = [
        [b"\xd4\x06a", b"\xc9\x00\x00\x00\x01\x06a", "\u0446\u0447", 0xD4D4, -44],
        [rng.random() for _ in range(2000)],  # every byte value, in floats
        {"x" * n: bytes([0xD4 + n % 5]) * n for n in range(1, 300, 7)},
        [bytes(range(256)) * 300, 1.0],
        [sibling(rng) for _ in range(500)],
    ]
    for value in values:
        assert encoded(enc, value) == unchecked(monkeypatch, enc, value)


def test_the_encoders_own_exts_are_byte_for_byte_as_before(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Atoms, tuples, dataclasses, big integers, tensors inline and spliced (large: their
    # own segments), at every level; slots through two directories of their own, so that
    # both lend the same names.
    rng = random.Random(3)
    big = torch.arange(40_000, dtype=torch.float32)  # 160 000 bytes: spliced
    value = {
        "atoms": [Atom(f"a{i}") for i in range(50)],
        "nested": (1, (Atom("x"), (big, 2**100)), Box((big, [Atom("y")]))),
        "plain": [sibling(rng) for _ in range(100)],
        "tensors": [torch.randn(8, 8), big, torch.ones(3, dtype=torch.bfloat16)],
    }
    enc = Encoder(REGISTRY)
    segments = enc.encode(value)
    assert len(segments) > 1  # spliced
    assert encoded(enc, value) == unchecked(monkeypatch, enc, value)
    dirs = []
    for name in "ab":
        (tmp_path / name).mkdir()
        (tmp_path / name).chmod(0o700)
        d = open_slot_dir(str(tmp_path / name), min_bytes=1024)
        assert d is not None
        dirs.append(d)
    try:
        checked = encoded(Encoder(REGISTRY, slots=dirs[0]), value)
        assert checked.count(b"r-") >= 3  # slots were lent
        assert checked == unchecked(monkeypatch, Encoder(REGISTRY, slots=dirs[1]), value)
    finally:
        for d in dirs:
            d.close()


def test_a_refused_value_gives_back_the_slots_it_took(slots) -> None:  # noqa: F811
    enc = Encoder(REGISTRY, slots=slots)
    value = [torch.arange(1000, dtype=torch.float64), forged(8)]
    refused(enc, value, "[1]")
    # The slot the tensor went into was handed back (the frame is never sent): lent again.
    body = encoded(enc, [torch.arange(1000, dtype=torch.float64)])
    assert msgpack.unpackb(body)[0].code == 8
    assert slots.write(memoryview(b"x" * 2000)) is not None
