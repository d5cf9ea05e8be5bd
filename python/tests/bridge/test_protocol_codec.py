"""The codec in this process: extension types, exact floats and tensors, refusals."""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
from collections import OrderedDict

import msgpack
import numpy as np
import pytest
import torch
from conftest import float_bits, same, tensor_bytes

from vllm_bridge.bridge.diag import Level, Sample
from vllm_bridge.bridge.protocol import Atom, BadArgument, Encoder, Ref, packb, registry_for, unpackb
from vllm_bridge.bridge.protocol.tensors import CODE_TO_DTYPE


def roundtrip(value):
    return unpackb(packb(value))


# -- scalars ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bits",
    [
        0x7FF8000000000000,  # the quiet NaN
        0x7FF8000000000001,  # a NaN with a payload
        0xFFF8000000000000,  # a negative NaN
        0x7FF4000000000000,  # a signalling NaN
        0x7FF0000000000000,  # +inf
        0xFFF0000000000000,  # -inf
        0x8000000000000000,  # -0.0
        0x0000000000000001,  # the smallest subnormal
    ],
)
def test_floats_keep_their_bits(bits):
    x = struct.unpack(">d", struct.pack(">Q", bits))[0]
    body = packb(x)
    assert body == b"\xcb" + struct.pack(">Q", bits)
    assert float_bits(roundtrip(x)) == bits


@pytest.mark.parametrize(
    "n", [2**64, -(2**63) - 1, 2**64 + 1, -(2**64), 2**1000 + 7, -(3**500)]
)
def test_integers_beyond_64_bits_use_ext_7_both_ways(n):
    body = packb(n)
    ext = msgpack.unpackb(body, ext_hook=lambda code, data: (code, data))
    assert ext[0] == 7
    assert ext[1][0] == (1 if n < 0 else 0)
    assert ext[1][1] != 0  # no leading zero byte
    assert int.from_bytes(ext[1][1:], "big") == abs(n)
    assert roundtrip(n) == n


@pytest.mark.parametrize("n", [2**64 - 1, -(2**63), 0, -1])
def test_integers_in_range_stay_plain(n):
    assert packb(n) == msgpack.packb(n)


def test_big_integer_decode_is_lenient_about_leading_zeros_but_not_the_sign():
    assert unpackb(bytes.fromhex("c7030700000a")) == 10
    with pytest.raises(BadArgument, match="sign byte"):
        unpackb(bytes.fromhex("d5070201"))


@pytest.mark.parametrize("sign", [1, -1])
def test_big_integers_at_the_protocols_cap_travel_and_over_it_are_refused_both_ways(sign):
    # 4 096 magnitude bytes is the BEAM's cap too (lib/vllm_bridge/codec/ext.ex): one
    # over it must be refused where it is made, not arrive as an undecodable reply.
    top = sign * (2 ** (8 * 4096) - 1)
    assert roundtrip(top) == top
    with pytest.raises(TypeError, match=r"32769 bits \(4097 bytes\).*limit of 4096"):
        packb(sign * 2 ** (8 * 4096))
    payload = b"\x00" + b"\x01" * 4097
    frame = msgpack.packb(msgpack.ExtType(7, payload))
    with pytest.raises(BadArgument, match="4097 magnitude bytes is over the protocol's limit of 4096"):
        unpackb(frame)


def test_atoms_tuples_and_lists_stay_apart():
    value = [Atom("a"), "a", (1, [2, (3,)]), [1, 2]]
    back = roundtrip(value)
    assert same(back, value)
    assert type(back[0]) is Atom and type(back[1]) is str
    assert repr(Atom("ok")) == "Atom('ok')"


def test_subclasses_and_numpy_scalars_travel_as_their_plain_types():
    class MyStr(str):
        pass

    value = [OrderedDict(a=1), MyStr("s"), np.float32(1.5), np.int64(7), np.bool_(True)]
    assert same(roundtrip(value), [{"a": 1}, "s", 1.5, 7, True])


# -- tensors ---------------------------------------------------------------------------


def _sample(dtype: torch.dtype) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (NaN and subnormal patterns included)."""
    gen = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (96,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (raw % 2).to(torch.bool).reshape(3, -1)
    return raw.view(dtype).reshape(3, -1)


@pytest.mark.parametrize("dtype", list(CODE_TO_DTYPE.values()), ids=str)
def test_every_dtype_of_the_table_round_trips_bit_exactly(dtype):
    t = _sample(dtype)
    back = roundtrip(t)
    assert back.dtype == dtype and back.shape == t.shape
    assert tensor_bytes(back) == tensor_bytes(t)


@pytest.mark.parametrize("shape", [(0,), (2, 0, 3), (), (1,), (0, 0)])
def test_empty_and_scalar_tensors(shape):
    t = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    assert same(roundtrip(t), t)


def test_non_contiguous_tensors_travel_as_their_contiguous_copy():
    base = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    for view in (base.t(), base[:, ::2], base[1:3, 1:5], base.expand(2, 4, 6)):
        assert not view.is_contiguous()
        assert packb(view) == packb(view.contiguous())
        assert same(roundtrip(view), view.contiguous())


def test_conjugated_negated_and_grad_tensors_travel_by_value():
    z = torch.tensor([1 + 2j, -3j], dtype=torch.complex64)
    assert same(roundtrip(z.conj()), z.conj().resolve_conj())
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    assert same(roundtrip(w * 2), torch.tensor([2.0, 4.0]))


def test_bfloat16_keeps_nan_and_negative_zero_bits():
    bits = torch.tensor([0x7FC1, 0x8000, 0xFF80, 0x0001], dtype=torch.int32).to(torch.int16)
    t = bits.view(torch.bfloat16)
    assert tensor_bytes(roundtrip(t)) == tensor_bytes(t)


def test_large_tensors_are_written_from_their_own_memory():
    t = torch.arange(1 << 16, dtype=torch.float32)  # 256 KiB
    segments = Encoder(registry_for()).encode(["ok", 1, (t, "x")])
    shared = [s for s in segments if isinstance(s, memoryview) and s.nbytes == t.nbytes]
    assert len(shared) == 1
    pointer = np.frombuffer(shared[0], dtype=np.uint8).ctypes.data
    assert pointer == t.data_ptr()
    inline = Encoder(registry_for(), large_tensor_bytes=1 << 40).packb(["ok", 1, (t, "x")])
    assert b"".join(segments) == inline
    assert same(unpackb(inline), ["ok", 1, (t, "x")])


def test_large_tensors_nested_in_dataclasses_and_tuples_splice_correctly():
    big = torch.ones(40_000, dtype=torch.float16)
    value = {"s": Sample("x", payload=((big, 1), [big])), "t": (big,)}
    spliced = Encoder(registry_for(), large_tensor_bytes=1024).packb(value)
    inline = Encoder(registry_for(), large_tensor_bytes=1 << 40).packb(value)
    assert spliced == inline
    assert same(unpackb(spliced), value)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("ff0000", "unknown tensor dtype code 255"),
        ("080100", "shorter than its 11-byte header"),
        ("0801000000000000000002" + "00" * 4, "needs 8 data bytes, got 4"),
        ("000100000000000000000102", "other than 0 or 1"),
        ("0801ff", "shorter than"),
    ],
)
def test_malformed_tensor_payloads_are_refused(payload, message):
    data = bytes.fromhex(payload)
    body = msgpack.packb(msgpack.ExtType(3, data))
    with pytest.raises(BadArgument, match=message):
        unpackb(body)


def test_numpy_arrays_travel_as_tensors():
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)[:, ::-1]
    assert same(roundtrip(arr), torch.tensor(arr.copy()))


# -- dataclasses, enums, references ------------------------------------------------------


def test_registered_dataclass_and_enum_round_trip():
    value = Sample("n", Level.HIGH, payload=[1, (2,)])
    assert same(roundtrip(value), value)
    assert same(roundtrip(Level.LOW), Level.LOW)


def test_an_atom_in_an_enum_field_becomes_the_member():
    def sample_body(level):
        fields = {"name": "a", "level": level}
        return msgpack.packb(msgpack.ExtType(4, packb(["vllm_bridge.bridge.diag.Sample", fields])))

    assert same(unpackb(sample_body(Atom("high"))), Sample("a", Level.HIGH))
    bad = sample_body(Atom("mid"))
    with pytest.raises(BadArgument, match=r":mid is not a member of vllm_bridge.bridge.diag.Level"):
        unpackb(bad)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (["os.Popen", {}], "unknown class 'os.Popen'"),
        (["vllm_bridge.bridge.diag.Opaque", {}], "unknown class 'vllm_bridge.bridge.diag.Opaque'"),
        (["vllm_bridge.bridge.diag.Sample", {"nope": 1}], "has no field 'nope'"),
        (["vllm_bridge.bridge.diag.Sample", {"name": 5}], "Sample.name must be a str"),
        (["vllm_bridge.bridge.diag.Sample", {}], "cannot build vllm_bridge.bridge.diag.Sample"),
        (["vllm_bridge.bridge.diag.Sample"], "dataclass payload must be"),
    ],
)
def test_dataclass_decoding_builds_registered_classes_only(payload, message):
    body = msgpack.packb(msgpack.ExtType(4, packb(payload)))
    with pytest.raises(BadArgument, match=message):
        unpackb(body)


def test_enum_decoding_refuses_unknown_names():
    with pytest.raises(BadArgument, match="has no member 'MID'"):
        unpackb(msgpack.packb(msgpack.ExtType(5, packb(["vllm_bridge.bridge.diag.Level", "MID"]))))
    with pytest.raises(BadArgument, match="unknown class"):
        unpackb(msgpack.packb(msgpack.ExtType(5, packb(["enum.Enum", "X"]))))


def test_values_of_unregistered_classes_need_a_session():
    @dataclasses.dataclass
    class Local:
        x: int

    class Color(enum.Enum):
        RED = 1

    odd_tensor = torch.empty(2, dtype=torch.float8_e4m3fn)
    for value in (Local(1), Color.RED, object(), {1, 2}, odd_tensor):
        with pytest.raises(TypeError, match="cannot travel by value"):
            packb(value)


@pytest.mark.parametrize(
    ("value", "pair"),
    [(slice(0, 4), (0, 4)), (slice(3, None), (3, None)), (slice(None, 2), (None, 2))],
)
def test_a_slice_without_a_step_travels_as_a_start_stop_pair(value, pair):
    assert unpackb(packb(value)) == pair
    assert packb(value) == packb(pair)


def test_a_slice_with_a_step_or_odd_bounds_needs_a_session():
    for value in (slice(0, 4, 2), slice(0.5, 2), slice("a", "b")):
        with pytest.raises(TypeError, match="cannot travel by value"):
            packb(value)


def test_references_made_by_the_encoder_nest_inside_values():
    made = []

    def make_ref(obj):
        made.append(obj)
        return Ref("00" * 8, len(made), "s", type(obj).__qualname__)

    opaque = object()
    body = Encoder(registry_for()).packb([Sample("a", payload=opaque), (opaque,)], make_ref)
    back = unpackb(body)
    assert made == [opaque, opaque]
    assert back[0].payload == Ref("00" * 8, 1, "s", "object")
    assert back[1] == (Ref("00" * 8, 2, "s", "object"),)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (msgpack.packb(msgpack.ExtType(6, packb(["i", -1, None, "t"]))), "ref_id"),
        (msgpack.packb(msgpack.ExtType(6, packb(["i", 1, None]))), "reference payload"),
        (msgpack.packb(msgpack.ExtType(9, b"")), "unknown extension type code 9"),
        (msgpack.packb(msgpack.ExtType(1, b"\xff")), "not UTF-8"),
        (msgpack.packb(msgpack.ExtType(2, b"\x01")), "tuple payload must be an array"),
        (msgpack.packb(msgpack.ExtType(2, b"\x92")), "malformed tuple payload"),
    ],
)
def test_malformed_extension_values_are_refused(body, message):
    with pytest.raises(BadArgument, match=message):
        unpackb(body)


def test_extension_nesting_is_bounded():
    body = b"\x90"
    for _ in range(100):
        body = msgpack.packb(msgpack.ExtType(2, b"\x91" + body))
    with pytest.raises(BadArgument, match="nest deeper than 64"):
        unpackb(body)


# -- msgpack's timestamp (ext type -1): not a type of the protocol ---------------------------

#: A timestamp in each form msgpack's unpacker reads as one (it builds the Timestamp itself,
#: never calling the ext hook): fixext 4 and 8 and ext 8 of 12 bytes (what msgpack writes),
#: and ext 8, 16 and 32 of 4, 8 or 12 bytes (what it reads all the same).
TIMESTAMPS = {
    "fixext4": msgpack.packb(msgpack.Timestamp(1, 0)),
    "fixext8": msgpack.packb(msgpack.Timestamp(2**33, 5)),
    "ext8_12": msgpack.packb(msgpack.Timestamp(2**40, 5)),
    "ext8_4": b"\xc7\x04\xff" + bytes(4),
    "ext16_8": b"\xc8\x00\x08\xff" + bytes(8),
    "ext32_12": b"\xc9\x00\x00\x00\x0c\xff" + bytes(12),
}
SAMPLE = packb("vllm_bridge.bridge.diag.Sample")
#: Where one may sit: the body, an array's item, a map's value and key, a tuple's item,
#: a dataclass's field (the last two: inside another extension's payload).
PLACES = {
    "body": lambda ts: ts,
    "item": lambda ts: b"\x92\x01" + ts,
    "value": lambda ts: b"\x81\xa1a" + ts,
    "key": lambda ts: b"\x81" + ts + b"\x01",
    "tuple": lambda ts: msgpack.packb(msgpack.ExtType(2, b"\x91" + ts)),
    "field": lambda ts: msgpack.packb(msgpack.ExtType(4, b"\x92" + SAMPLE + b"\x81\xa4name" + ts)),
}


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("form", TIMESTAMPS)
def test_a_timestamp_is_refused_on_input(form, place):
    assert isinstance(msgpack.unpackb(TIMESTAMPS[form]), msgpack.Timestamp)  # msgpack's own
    with pytest.raises(BadArgument, match=r"unknown extension type code -1 \(msgpack's timestamp"):
        unpackb(PLACES[place](TIMESTAMPS[form]))


def test_a_timestamp_across_a_mib_of_a_large_frame_is_refused():
    # A frame of 1 MiB or more, read into a buffer of its own, is looked at a MiB at a time;
    # here the timestamp's header starts in the first MiB and ends in the second.
    filler = (1 << 20) - 7
    body = b"\x92\xc6" + struct.pack(">I", filler) + bytes(filler) + TIMESTAMPS["fixext4"]
    assert body.index(b"\xd6\xff") == (1 << 20) - 1
    with pytest.raises(BadArgument, match="unknown extension type code -1"):
        unpackb(memoryview(bytearray(body)))


def test_the_bytes_of_a_timestamp_header_elsewhere_decode():
    value = [b"\xd6\xff\x00\x00\x00\x01", 0xD6, -1, b"\xc9\x00\x00\x00\x0c\xff", "x"]
    assert unpackb(packb(value)) == value
    big = [bytes(1 << 20) + b"\xd7\xff" + bytes(8), -1]
    assert unpackb(memoryview(bytearray(packb(big)))) == big


@pytest.mark.parametrize(
    "value",
    [
        msgpack.Timestamp(1, 0),
        [1, msgpack.Timestamp(2**40, 5)],
        {"a": msgpack.Timestamp(1, 0)},
        {msgpack.Timestamp(1, 0): 1},
        (msgpack.Timestamp(1, 0),),
        Sample("a", payload=[msgpack.Timestamp(1, 0)]),
    ],
    ids=["alone", "item", "value", "key", "tuple", "field"],
)
def test_a_timestamp_is_refused_on_output(value):
    # msgpack packs one itself (ext -1), never asking the encoder's default: refused,
    # also where anything else without an encoding would become a reference.
    made = []
    for make_ref in (None, lambda obj: made.append(obj) or Ref("00" * 8, 1, "s", "x")):
        with pytest.raises(TypeError, match="msgpack Timestamp .* has no encoding"):
            Encoder(registry_for()).packb(value, make_ref)
    assert made == []


def test_the_bytes_of_a_timestamp_header_elsewhere_encode():
    value = [b"\xd6\xff\x00\x00\x00\x01", 0xD6, -1, (b"\xc7\x0c\xff",), {"k": b"\xd7\xff"}]
    assert unpackb(packb(value)) == value
