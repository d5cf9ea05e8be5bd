"""Large tensors taken out of large frames with one copy (vllm_bridge.bridge.protocol.splice):
the result is what the plain msgpack path gives, and anything the walk does not take
falls back to it."""

import msgpack
import pytest
import torch

from vllm_bridge import PUBLIC_MODULES
from vllm_bridge.bridge.protocol import BadArgument, Decoder, Encoder, ProtocolError, TypeRegistry
from vllm_bridge.bridge.protocol import splice
from vllm_bridge.bridge.protocol.decoder import _Pass

ENCODER = Encoder(TypeRegistry(PUBLIC_MODULES))


def _frame(value: object) -> bytearray:
    return bytearray(ENCODER.packb(value))


def _plain(data: bytes | bytearray) -> object:
    return _Pass().unpack(data)  # msgpack alone, no splicing


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _big(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64).to(dtype)


def test_large_tensors_in_arrays_and_maps_come_out_aligned_and_equal() -> None:
    value = ["call", 7, None, 1000, ["m", "x", "y"],
             [_big(300_000), 3, _big(40_000, torch.int16)],
             {"w": _big(100_000, torch.float64), "small": _big(5)}]
    data = _frame(value)
    spliced = splice.splice_tensors(data)
    assert spliced is not None and len(spliced.tensors) == 3
    assert len(spliced.body) < 2_000  # only the tokens and the small values are left
    decoded = Decoder().decode(data).value
    assert _same(decoded, _plain(data)) and _same(decoded, value)
    for t in (decoded[5][0], decoded[5][2], decoded[6]["w"]):
        assert t.data_ptr() % t.element_size() == 0
    # the tensors own their memory: the frame buffer can be reused
    data[:] = b"\0" * len(data)
    assert torch.equal(decoded[5][0], value[5][0])


def test_shapes_dtypes_and_bool_tensors_survive() -> None:
    value = [_big(2 * 3 * 50_000).reshape(2, 3, 50_000),
             torch.ones(1 << 20, dtype=torch.bool),
             torch.zeros(0, 1 << 20)]
    data = _frame(value)
    assert _same(Decoder().decode(data).value, value)


def test_bad_large_tensor_data_is_refused_as_on_the_plain_path() -> None:
    data = _frame([torch.ones(1 << 20, dtype=torch.bool)])
    data[-1] = 2
    with pytest.raises(BadArgument, match="bool tensor data holds a byte other than 0 or 1"):
        Decoder().decode(data)
    header = ENCODER.packb(torch.zeros(1 << 18))
    # claim a dtype code that does not exist: the first payload byte after the ext header
    bad = bytearray(msgpack.packb([1]))[:1] + bytearray(header)
    bad[1 + 6] = 99
    with pytest.raises(BadArgument, match="unknown tensor dtype code 99"):
        Decoder().decode(bad)


@pytest.mark.parametrize(
    "value",
    [
        [(_big(300_000), 1)],  # inside a tuple (ext 2): left to msgpack
        [_big(300_000)] + list(range(splice.MAX_WALK)),  # too many values to walk
        [b"x" * (2 << 20)],  # large, but no tensor
    ],
    ids=["nested-in-tuple", "too-many-values", "no-tensor"],
)
def test_frames_the_walk_does_not_take_decode_as_before(value: list) -> None:
    data = _frame(value)
    assert len(data) >= splice.SPLICE_MIN_FRAME
    assert splice.splice_tensors(data) is None
    assert _same(Decoder().decode(data).value, value)


def test_malformed_and_short_frames_are_left_to_msgpack() -> None:
    data = _frame([_big(300_000)])
    assert splice.splice_tensors(data[:-10]) is None  # truncated: the walk gives up
    # msgpack decodes it, and its failure is reported as a protocol error
    with pytest.raises(ProtocolError, match="ends in the middle of a value"):
        Decoder().decode(data[:-10])
    small = _frame([_big(1000)])
    assert splice.splice_tensors(small) is None
    assert splice.splice_tensors(bytearray(b"\xc1" * (2 << 20))) is None


def test_a_token_of_another_frame_is_not_taken_for_one_of_this_frame() -> None:
    spliced = splice.splice_tensors(_frame([_big(300_000)]))
    assert spliced is not None
    other = splice.splice_tensors(_frame([_big(300_000)]))
    assert other is not None and other.nonce != spliced.nonce
    token = other.body[3:19]  # fixarray, fixext16 header, then the 16-byte token
    assert other.lookup(token) is other.tensors[0]
    assert spliced.lookup(token) is None
