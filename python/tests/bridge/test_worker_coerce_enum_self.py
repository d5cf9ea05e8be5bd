"""The worker turns an atom into an enum member for the ``self`` of an enum's own method."""

import enum

import pytest

from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.bridge.protocol import Atom
from vllm_bridge.bridge.protocol.errors import BadArgument
from vllm_bridge.bridge.worker.coerce import coerce_arguments


class Color(enum.Enum):
    RED = 1

    def name_twice(self) -> str:
        return self.name * 2

    @staticmethod
    def shout(word: str) -> str:
        return word.upper()


def test_self_of_an_enum_method_takes_an_atom() -> None:
    args, kwargs = coerce_arguments(
        CUDAGraphMode.has_mode, [Atom("full_and_piecewise"), Atom("piecewise")], {}, "t"
    )
    assert args == [CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.PIECEWISE]
    assert CUDAGraphMode.has_mode(*args) is True
    assert coerce_arguments(Color.name_twice, [Atom("red")], {}, "t")[0] == [Color.RED]


def test_an_unknown_member_names_the_atom() -> None:
    with pytest.raises(BadArgument, match=":blue is not a member"):
        coerce_arguments(Color.name_twice, [Atom("blue")], {}, "t")


def test_static_methods_and_plain_functions_are_left_alone() -> None:
    assert coerce_arguments(Color.shout, [Atom("red")], {}, "t")[0] == ["red"]
    assert coerce_arguments(str.upper, [Atom("red")], {}, "t")[0] == ["red"]
