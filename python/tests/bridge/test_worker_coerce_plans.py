"""The cache of coercion plans: bounded, keeps no called object alive, and is not
steered by a callable's own ``__eq__``/``__hash__``; a plan still follows the signature."""

from __future__ import annotations

import enum
import gc
import weakref

import pytest
from conftest import next_id, spawn_worker

from vllm_bridge.bridge.protocol import Atom
from vllm_bridge.bridge.protocol.errors import BadArgument
from vllm_bridge.bridge.worker import coerce
from vllm_bridge.bridge.worker.coerce import coerce_arguments

D = "vllm_bridge.bridge.diag"


class Mode(enum.Enum):
    FAST = 1
    SLOW = 2


class Shade(enum.Enum):
    DARK = 1


class Box(list):
    """A list that weak references reach: ``Box().append`` is a bound C method."""

    def pick(self, mode: Mode) -> Mode:
        return mode


def cached() -> int:
    """How many plans the cache holds."""
    return len(coerce._plans) + len(getattr(coerce, "_bound_plans", ()))


def make_picker(annotation: type) -> object:
    """A new function on every call, its ``mode`` annotated with ``annotation``."""

    def pick(x: int, mode: object) -> object:
        return mode

    pick.__annotations__["mode"] = annotation
    return pick


def test_bound_methods_leave_the_cache_bounded_and_their_objects_free() -> None:
    n0 = cached()
    boxes = [Box() for _ in range(1000)]
    for box in boxes:
        assert coerce_arguments(box.append, [Atom("fast")], {}, "t") == ([Atom("fast")], {})
        assert coerce_arguments(box.pick, [Atom("fast")], {}, "t") == ([Mode.FAST], {})
    assert cached() - n0 <= 1
    refs = [weakref.ref(b) for b in boxes]
    del boxes, box
    gc.collect()
    assert [r for r in refs if r() is not None] == []


def test_fresh_functions_neither_pile_up_nor_stay_alive() -> None:
    pickers = [make_picker(Mode) for _ in range(1000)]
    for p in pickers:
        assert coerce_arguments(p, [1, Atom("slow")], {}, "t") == ([1, Mode.SLOW], {})
    assert cached() < 1000
    refs = [weakref.ref(p) for p in pickers]
    del pickers, p
    gc.collect()
    assert [r for r in refs if r() is not None] == []


def test_a_generator_sent_an_atom_is_finalised_once_released() -> None:
    closed = []

    def gen():
        try:
            while True:
                yield
        except GeneratorExit:
            closed.append(True)
            raise

    g = gen()
    next(g)
    assert coerce_arguments(g.send, [Atom("x")], {}, "t") == ([Atom("x")], {})
    ref = weakref.ref(g)
    del g
    gc.collect()
    assert ref() is None and closed == [True]


def test_a_worker_finalises_a_released_generator_that_was_sent_an_atom() -> None:
    w = spawn_worker([])
    try:
        w.call(D, "exit_log", True)
        g = w.call(D, "count", 5, 0.0, "atom-sent", session="s")
        assert w.invoke(["r", g, "send"], [None], session="s") == 0
        assert w.invoke(["r", g, "send"], [Atom("x")], session="s") == 1
        rid = next_id()
        assert w.request(["release", rid, "s", [g]]) == ["ok", rid, 1]
        assert w.call(D, "exit_log") == [
            {"name": "atom-sent", "type": "builtins.GeneratorExit", "message": ""}
        ]
    finally:
        w.stop()


class Liar(type):
    """Every class of this kind claims to equal every other, with one hash (only its own
    kind: inspect.signature itself asks whether a class equals ``type`` or ``object``)."""

    def __eq__(cls, other: object) -> bool:
        return isinstance(other, Liar) or NotImplemented

    def __hash__(cls) -> int:
        return 0


class Refuser(type):
    """A class of this kind cannot be hashed, nor compared with its own kind."""

    def __eq__(cls, other: object) -> bool:
        if isinstance(other, Refuser):
            raise RuntimeError("no __eq__")
        return NotImplemented

    def __hash__(cls) -> int:
        raise RuntimeError("no __hash__")


def test_a_callable_that_lies_about_equality_gets_its_own_plan() -> None:
    class Fast(metaclass=Liar):
        def __init__(self, mode: Mode) -> None:
            self.mode = mode

    class Dark(metaclass=Liar):
        def __init__(self, shade: Shade) -> None:
            self.shade = shade

    assert coerce_arguments(Fast, [Atom("fast")], {}, "t") == ([Mode.FAST], {})
    assert coerce_arguments(Dark, [Atom("dark")], {}, "t") == ([Shade.DARK], {})
    assert coerce_arguments(Fast, [Atom("slow")], {}, "t") == ([Mode.SLOW], {})


def test_a_callable_whose_eq_and_hash_raise_is_coerced() -> None:
    class Slow(metaclass=Refuser):
        def __init__(self, mode: Mode) -> None:
            self.mode = mode

    for _ in range(2):
        assert coerce_arguments(Slow, [Atom("slow")], {}, "t") == ([Mode.SLOW], {})


def test_a_plan_follows_a_rebound_method_and_a_reused_address() -> None:
    box = Box()
    assert coerce_arguments(box.pick, [Atom("fast")], {}, "t") == ([Mode.FAST], {})

    def pick(self: Box, shade: Shade) -> Shade:
        return shade

    old = Box.pick
    Box.pick = pick  # type: ignore[method-assign]
    try:
        assert coerce_arguments(box.pick, [Atom("dark")], {}, "t") == ([Shade.DARK], {})
    finally:
        Box.pick = old  # type: ignore[method-assign]
    with pytest.raises(BadArgument, match=":dark is not a member"):
        coerce_arguments(box.pick, [Atom("dark")], {}, "t")
    # A dead function's address given to a new one with another enum: not its plan.
    cases = [(Mode, "fast", Mode.FAST), (Shade, "dark", Shade.DARK)] * 100
    for annotation, atom, member in cases:
        assert coerce_arguments(make_picker(annotation), [0, Atom(atom)], {}, "t")[0] == [0, member]
