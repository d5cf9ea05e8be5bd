"""BatchDescriptor: field layout, immutability, hashing, validation, relaxing."""

import dataclasses

import pytest

from vllm_bridge.forward_context import BatchDescriptor


def test_wire_identity_and_field_order() -> None:
    # The wire protocol names dataclasses by module.qualname with fields in order.
    assert f"{BatchDescriptor.__module__}.{BatchDescriptor.__qualname__}" == (
        "vllm_bridge.forward_context.BatchDescriptor"
    )
    fields = [(f.name, f.default) for f in dataclasses.fields(BatchDescriptor)]
    assert fields == [
        ("num_tokens", dataclasses.MISSING),
        ("num_reqs", None),
        ("uniform", False),
        ("has_lora", False),
        ("num_active_loras", 0),
    ]


def test_frozen() -> None:
    desc = BatchDescriptor(num_tokens=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        desc.num_tokens = 16  # type: ignore[misc]


def test_equal_descriptors_key_the_same_graph() -> None:
    graphs = {BatchDescriptor(256, num_reqs=8, uniform=True): "g256"}
    assert graphs[BatchDescriptor(num_tokens=256, num_reqs=8, uniform=True)] == "g256"
    assert BatchDescriptor(256, num_reqs=8) not in graphs
    assert BatchDescriptor(256, num_reqs=8, uniform=True, has_lora=True) not in graphs


def test_relax_drops_num_reqs_and_uniform_keeps_lora() -> None:
    desc = BatchDescriptor(256, num_reqs=8, uniform=True, has_lora=True, num_active_loras=3)
    relaxed = desc.relax_for_mixed_batch_cudagraphs()
    assert relaxed == BatchDescriptor(256, None, False, True, 3)
    assert desc.num_reqs == 8  # the original is untouched


@pytest.mark.parametrize(
    "kwargs, exc, needle",
    [
        ({"num_tokens": -1}, ValueError, "num_tokens must be >= 0, got -1"),
        ({"num_tokens": 2.5}, TypeError, "num_tokens must be an int, got 2.5"),
        ({"num_tokens": True}, TypeError, "num_tokens must be an int, got True"),
        ({"num_tokens": 4, "num_reqs": -2}, ValueError, "num_reqs must be >= 0, got -2"),
        ({"num_tokens": 4, "uniform": 1}, TypeError, "uniform must be a bool, got 1"),
        ({"num_tokens": 4, "has_lora": "yes"}, TypeError, "has_lora must be a bool"),
        ({"num_tokens": 4, "num_active_loras": -1}, ValueError, "num_active_loras"),
    ],
)
def test_bad_fields_are_refused_naming_the_value(kwargs: dict, exc: type, needle: str) -> None:
    with pytest.raises(exc, match=needle.replace("(", r"\(")):
        BatchDescriptor(**kwargs)
