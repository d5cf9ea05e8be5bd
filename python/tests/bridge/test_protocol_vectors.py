"""Every byte vector of priv/protocol/vectors.txt: encode == bytes and decode == value, in
this process and through a real worker (diag.echo)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import load_vectors, next_id, same

from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import BatchDescriptor
from vllm_bridge.bridge.protocol import Atom, BadArgument, Ref, packb, unpackb

VECTORS = load_vectors()

#: name -> the Python value the vector encodes.
VALUES = {
    "nil": None,
    "true": True,
    "false": False,
    "int_0": 0,
    "int_127": 127,
    "int_128": 128,
    "int_255": 255,
    "int_256": 256,
    "int_65535": 65535,
    "int_65536": 65536,
    "int_u32_max": 2**32 - 1,
    "int_2_32": 2**32,
    "int_i64_max": 2**63 - 1,
    "int_u64_max": 2**64 - 1,
    "int_neg_1": -1,
    "int_neg_32": -32,
    "int_neg_33": -33,
    "int_neg_128": -128,
    "int_neg_129": -129,
    "int_neg_32768": -32768,
    "int_neg_32769": -32769,
    "int_i64_min": -(2**63),
    "bigint_2_64": 2**64,
    "bigint_neg_2_64_minus_1": -(2**64) - 1,
    "bigint_2_100": 2**100,
    "float_1_5": 1.5,
    "float_neg_zero": -0.0,
    "float_pi": math.pi,
    "float_nan": math.nan,
    "float_inf": math.inf,
    "float_neg_inf": -math.inf,
    "str_empty": "",
    "str_utf8": "héllo ✓",
    "str_32": "a" * 32,
    "bin_bytes": b"\x00\xff\x80",
    "array_empty": [],
    "array_mixed": [1, "two", None, 3.0, [True]],
    "map_empty": {},
    "map_nested": {"a": 1, "b": {"c": [1, 2]}},
    "atom_ok": Atom("ok"),
    "atom_full": Atom("full"),
    "tuple_pair": (1, "a"),
    "tuple_empty": (),
    "map_atom_keys": {Atom("num_tokens"): 8, Atom("uniform"): True},
    "tensor_f32_2x2": torch.tensor([[1.0, -2.5], [0.0, 3.25]], dtype=torch.float32),
    "tensor_i64_vec": torch.tensor([7, -1, 2**40], dtype=torch.int64),
    "tensor_i32_empty_0x3": torch.empty((0, 3), dtype=torch.int32),
    "tensor_bool_scalar": torch.tensor(True),
    "tensor_bf16_vec": torch.tensor([1.0, -6.0], dtype=torch.bfloat16),
    "dataclass_batch_descriptor": BatchDescriptor(num_tokens=8),
    "enum_cudagraph_full": CUDAGraphMode.FULL,
    "ref_object": Ref("00112233aabbccdd", 42, "s1", "torch.nn.modules.linear.Linear"),
    "msg_call": ["call", 7, "s1", 5000, ["m", "vllm_bridge.bridge.diag", "add"], [40, 2], {}],
    "msg_ok": ["ok", 7, 42],
    "msg_error": [
        "error",
        7,
        {
            "type": "python_exception",
            "message": "boom",
            "python_type": "ValueError",
            "traceback": "Traceback",
            "exc_id": 1,
        },
    ],
    "msg_ping": ["ping", 9],
    "msg_cancel": ["cancel", 7],
}

#: Vectors checked in one direction only, and why.
DECODE_ONLY = {
    # Python decodes any tensor to a CPU tensor; making the cuda:0 bytes needs a CUDA
    # tensor, which test_encode_cuda_tensor_vector does where a GPU exists.
    "tensor_f32_cuda": torch.tensor([0.5], dtype=torch.float32),
}

#: Vectors of maps Python refuses (docs/PROTOCOL.md, "Map keys"): what the error names.
REFUSED = {
    "refuse_map_int_bool": "the map keys 1 and true are equal in Python",
    "refuse_map_int_float": "the map keys 1 and 1.0 are equal in Python",
    "refuse_map_atom_str": 'the map keys :a and "a" are equal in Python',
    "refuse_map_tuple_keys": 'the map keys {1, "a"} and {true, :a} are equal in Python',
    "refuse_map_list_key": "the map key [1] is a list",
    "refuse_map_map_key": "the map key %{} is a map",
    "refuse_map_tuple_holding_list": "the map key {1, [2]} holds a list ([2])",
}

#: Vectors that cannot come back unchanged from a worker's echo, and why.
NOT_ECHOED = {
    # A reference names an object of one worker process; this one names none of ours,
    # so the worker refuses it (test_worker_sessions covers that: session_lost).
    "ref_object",
    # The worker decodes it to a CPU tensor; its echo says device "" (cpu).
    "tensor_f32_cuda",
    # Its slot exists in no directory (and this worker has none).
    "tensor_slot_f32_2x2_e7",
}


#: Tensors in slots (ext 8): the header and the slot the bytes name; decoding them
#: reads the slot (test_protocol_slots.py), so here only their parts are checked.
SLOTS = {
    "tensor_slot_f32_2x2_e7": (torch.zeros(2, 2, dtype=torch.float32), "e-7"),
}


def test_tables_cover_every_vector():
    assert set(VALUES) | set(DECODE_ONLY) | set(REFUSED) | set(SLOTS) == set(VECTORS)
    assert not set(VALUES) & set(DECODE_ONLY)
    assert not set(REFUSED) & (set(VALUES) | set(DECODE_ONLY))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_vectors_are_refused_naming_the_keys(name):
    with pytest.raises(BadArgument) as info:
        unpackb(VECTORS[name])
    assert REFUSED[name] in str(info.value)


def test_refused_vectors_get_bad_argument_under_their_id_from_a_worker(shared_worker):
    target = packb(["m", "vllm_bridge.bridge.diag", "echo"])
    for name in sorted(REFUSED):
        rid = next_id()
        head = b"\x97" + packb("call") + packb(rid) + packb(None) + packb(30_000)
        shared_worker.send_raw(head + target + b"\x91" + VECTORS[name] + b"\x80")
        kind, got, err = unpackb(shared_worker.recv_raw())
        assert (kind, got, err["type"]) == ("error", rid, "bad_argument"), name
        assert err["message"].startswith("could not decode args[0]: " + REFUSED[name])


@pytest.mark.parametrize("name", sorted(VALUES))
def test_encode_gives_the_vector_bytes(name):
    assert packb(VALUES[name]) == VECTORS[name]


@pytest.mark.parametrize("name", sorted(VALUES) + sorted(DECODE_ONLY))
def test_decode_gives_the_value(name):
    expected = VALUES[name] if name in VALUES else DECODE_ONLY[name]
    assert same(unpackb(VECTORS[name]), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for cuda:0")
def test_encode_cuda_tensor_vector():
    t = torch.tensor([0.5], dtype=torch.float32, device="cuda:0")
    assert packb(t) == VECTORS["tensor_f32_cuda"]


def test_every_echoable_vector_comes_back_bit_exact_from_a_worker(shared_worker):
    """The vector's bytes are spliced raw into a call of diag.echo; the reply must carry
    exactly the same bytes back (decode then encode in the worker loses nothing)."""
    target = packb(["m", "vllm_bridge.bridge.diag", "echo"])
    for name in sorted(set(VECTORS) - NOT_ECHOED - set(REFUSED)):
        rid = next_id()
        head = b"\x97" + packb("call") + packb(rid) + packb(None) + packb(30_000)
        shared_worker.send_raw(head + target + b"\x91" + VECTORS[name] + b"\x80")
        body = shared_worker.recv_raw()
        assert body == b"\x93" + packb("ok") + packb(rid) + VECTORS[name], name


@pytest.mark.parametrize("name", sorted(SLOTS))
def test_slot_vectors_are_the_header_and_the_slot_name(name):
    import msgpack

    from vllm_bridge.bridge.protocol.slots import slot_payload, split_payload
    from vllm_bridge.bridge.protocol.tensors import tensor_parts

    tensor, slot = SLOTS[name]
    header, _ = tensor_parts(tensor)
    assert msgpack.packb(msgpack.ExtType(8, slot_payload(header, slot))) == VECTORS[name]
    assert split_payload(msgpack.unpackb(VECTORS[name]).data) == (header, slot)
