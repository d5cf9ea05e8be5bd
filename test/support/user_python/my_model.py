"""A user's own Python module, bound by the generator's tests (``mix vllm.gen.bindings
--module my_model --prefix MyApp.Py``): a dataclass, an enum, a context manager, a
function with keyword-only arguments, and type hints naming the library's dataclass and
enum."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Iterator

from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import BatchDescriptor

__all__ = ["Cfg", "Kind", "MyModel", "scaled", "describe_batch", "scope", "make_cfg", "VERSION"]

#: The module's version, a data attribute.
VERSION: str = "1.0"


class Kind(enum.Enum):
    """How the model runs."""

    EAGER = 1
    GRAPH = 2


@dataclasses.dataclass
class Cfg:
    """The model's configuration.

    Attributes:
        width: hidden size.
        kind: how it runs.
    """

    width: int
    kind: Kind = Kind.EAGER
    tags: list[str] = dataclasses.field(default_factory=list)

    def doubled(self) -> int:
        """Twice the width."""
        return 2 * self.width


@dataclasses.dataclass(frozen=True)
class MyModel:
    """The class carrying the module's own name: bound as the base module itself."""

    name: str = "tiny"


def scaled(
    x: float, factor: float = 2.0, *, offset: float = 0.0, label: str
) -> dict[str, float | str]:
    """Scale ``x``.

    Args:
        x: the value.
        factor: multiplier.
        offset: added after scaling.
        label: a name echoed back.
    """
    return {"value": x * factor + offset, "label": label}


def describe_batch(batch: BatchDescriptor, *, mode: CUDAGraphMode | None = None) -> CUDAGraphMode:
    """The CUDA-graph mode a batch would run under: ``mode`` when given, else ``NONE``
    for a batch with no tokens, ``FULL`` otherwise."""
    if mode is not None:
        return mode
    return CUDAGraphMode.NONE if batch.num_tokens == 0 else CUDAGraphMode.FULL


def make_cfg(width: int, kind: Kind = Kind.GRAPH) -> Cfg:
    """A configuration, returned by value (decoded as the generated struct)."""
    return Cfg(width=width, kind=kind, tags=["made"])


_depth = 0


@contextlib.contextmanager
def scope(name: str) -> Iterator[int]:
    """Enter a named scope; yields the nesting depth inside it."""
    global _depth
    _depth += 1
    try:
        yield _depth
    finally:
        _depth -= 1
