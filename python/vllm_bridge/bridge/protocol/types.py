"""Value types of the wire protocol that have no plain Python counterpart.

* :class:`Atom` - an Elixir atom (ext 1); a ``str`` subclass, so atom keys work as
  keyword names and compare equal to the plain string of the same name.
* :class:`Ref` - an object reference (ext 6): an object that lives in one worker process
  and is owned by one session.
* :class:`ExtCode` - the one table of msgpack extension codes (docs/PROTOCOL.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vllm_bridge.bridge.protocol.errors import short_repr


class ExtCode(enum.IntEnum):
    """msgpack extension type codes of protocol version 1."""

    ATOM = 1
    TUPLE = 2
    TENSOR = 3
    DATACLASS = 4
    ENUM = 5
    REF = 6
    BIGINT = 7
    SLOT_TENSOR = 8


class Atom(str):
    """An Elixir atom. Equal to (and hashes like) the ``str`` of the same name."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Atom({str.__repr__(self)})"


@dataclass(frozen=True)
class Ref:
    """A reference to an object held by a worker process.

    Attributes:
        instance: The handshake ``instance`` of the worker process that holds the object.
        ref_id: Identifier of the reference, unique within that process.
        session: The owning session (``None`` = the worker's default session).
        type_name: Qualified class name of the object (informational only), or
            ``"context"`` for the handle of an entered context manager.
    """

    instance: str
    ref_id: int
    session: str | None
    type_name: str

    def __post_init__(self) -> None:
        if not isinstance(self.instance, str):
            raise TypeError(f"Ref.instance must be a str, got {short_repr(self.instance)}")
        if isinstance(self.ref_id, bool) or not isinstance(self.ref_id, int) or self.ref_id < 0:
            raise ValueError(
                f"Ref.ref_id must be a non-negative int, got {short_repr(self.ref_id)}"
            )
        if self.session is not None and not isinstance(self.session, str):
            raise TypeError(f"Ref.session must be a str or None, got {short_repr(self.session)}")
        if not isinstance(self.type_name, str):
            raise TypeError(f"Ref.type_name must be a str, got {short_repr(self.type_name)}")


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class, as the wire spells class names."""
    return f"{cls.__module__}.{cls.__qualname__}"
