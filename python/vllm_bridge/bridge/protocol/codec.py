"""One-call encode/decode for code outside the worker (tests, tools, benchmarks).

The worker uses :class:`~vllm_bridge.bridge.protocol.encoder.Encoder` and
:class:`~vllm_bridge.bridge.protocol.decoder.Decoder` directly, with its own allow-list and
session references. These helpers use the default allow-list
(``vllm_bridge.PUBLIC_MODULES``), create no references, and leave decoded references as
:class:`~vllm_bridge.bridge.protocol.types.Ref` values.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm_bridge import PUBLIC_MODULES
from vllm_bridge.bridge.protocol.decoder import Decoder
from vllm_bridge.bridge.protocol.materialize import materialize
from vllm_bridge.bridge.protocol.encoder import Encoder
from vllm_bridge.bridge.protocol.registry import TypeRegistry

_registries: dict[frozenset[str], TypeRegistry] = {}


def registry_for(modules: Iterable[str] = PUBLIC_MODULES) -> TypeRegistry:
    """The (cached) :class:`TypeRegistry` of an allow-list."""
    key = frozenset(modules)
    reg = _registries.get(key)
    if reg is None:
        reg = _registries[key] = TypeRegistry(key)
    return reg


def packb(value: Any, modules: Iterable[str] = PUBLIC_MODULES) -> bytes:
    """Encode ``value`` into one msgpack body.

    Raises:
        TypeError: ``value`` holds something that can only travel as a reference.
    """
    return Encoder(registry_for(modules)).packb(value)


def unpackb(data: bytes | bytearray | memoryview, modules: Iterable[str] = PUBLIC_MODULES) -> Any:
    """Decode one msgpack body, building registered dataclasses and enum members.

    Raises:
        BadArgument: a malformed extension value or an unregistered class name.
        ValueError: malformed msgpack.
    """
    decoded = Decoder().decode(data)
    if not decoded.special:
        return decoded.value
    return materialize(decoded.value, registry_for(modules))
