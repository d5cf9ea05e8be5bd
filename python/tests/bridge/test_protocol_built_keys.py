"""Map keys built in the worker (references resolved, dataclasses built) run the built
objects' own ``__hash__`` and ``__eq__``: whatever those do (raise, answer with something
that is not a bool, make two keys one), the request is refused with ``bad_argument``
naming the key and its place, never failed with an error of the worker, and the worker
serves on (materialize.materialize)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import WorkerCallError, WorkerProc, spawn_worker
D = "vllm_bridge.bridge.diag"
K = "keys_support"


@pytest.fixture(scope="module")
def w() -> Iterator[WorkerProc]:
    wp = spawn_worker(["--allow", D, K], support=True)
    try:
        yield wp
    finally:
        wp.stop()


def refusal(w: WorkerProc, arg: Any) -> str:
    with pytest.raises(WorkerCallError) as info:
        w.call(D, "echo", arg)
    assert info.value.error["type"] == "bad_argument", info.value.error
    return info.value.error["message"]


def test_a_key_whose_equality_is_not_a_bool_is_refused(w: WorkerProc) -> None:
    a, b = w.call(K, "make", "OddEquality"), w.call(K, "make", "OddEquality")
    message = refusal(w, [{a: 1, b: 2}])
    assert message.startswith("args[0][")
    assert "cannot be a dict key: hashing it or comparing it with another key raised " in message
    assert "RuntimeError: the truth of this comparison is ambiguous" in message
    assert w.call(D, "add", 1, 2) == 3


def test_a_key_whose_hash_raises_is_refused(w: WorkerProc) -> None:
    key = w.call(K, "make", "HashRaises")
    message = refusal(w, {"outer": {key: 1}})
    assert message.startswith('args[0]["outer"][')
    assert "raised ValueError: no hash today" in message


def test_two_references_to_one_object_are_one_key(w: WorkerProc) -> None:
    obj = w.call(K, "make", "Plain")
    again = w.get(["r", obj, None])  # a second reference to the same object
    assert again.ref_id != obj.ref_id
    message = refusal(w, [1, {obj: "x", again: "y"}])
    assert message.startswith(f"args[0][1][reference {again.ref_id} (keys_support.Plain)]: ")
    assert "are equal in Python (they are one object (two references to it))" in message


def test_distinct_objects_are_distinct_keys(w: WorkerProc) -> None:
    a, b = w.call(K, "make", "Plain"), w.call(K, "make", "Plain")
    back = w.call(D, "echo", [{a: 1, b: 2}])
    assert [list(d.values()) for d in back] == [[1, 2]]
