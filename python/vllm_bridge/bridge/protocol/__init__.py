"""The wire protocol between the Elixir runtime and a Python worker (docs/PROTOCOL.md).

Public names: :class:`Atom`, :class:`Ref`, :class:`ExtCode`, :func:`packb`,
:func:`unpackb`, the error classes, and the :class:`Encoder` / :class:`Decoder` /
:class:`TypeRegistry` the worker is built from.
"""

from vllm_bridge.bridge.protocol.codec import packb, registry_for, unpackb
from vllm_bridge.bridge.protocol.decoder import Decoder
from vllm_bridge.bridge.protocol.materialize import PendingEnum, PendingStruct, materialize
from vllm_bridge.bridge.protocol.encoder import Encoder
from vllm_bridge.bridge.protocol.errors import (
    BadArgument,
    BridgeError,
    Cancelled,
    DeadlineExceeded,
    ProtocolError,
    SessionLost,
)
from vllm_bridge.bridge.protocol.registry import TypeRegistry
from vllm_bridge.bridge.protocol.types import Atom, ExtCode, Ref

__all__ = [
    "Atom",
    "BadArgument",
    "BridgeError",
    "Cancelled",
    "DeadlineExceeded",
    "Decoder",
    "Encoder",
    "ExtCode",
    "PendingEnum",
    "PendingStruct",
    "ProtocolError",
    "Ref",
    "SessionLost",
    "TypeRegistry",
    "materialize",
    "packb",
    "registry_for",
    "unpackb",
]
