"""Python values -> msgpack bodies, with the extension types of docs/PROTOCOL.md.

The C msgpack packer does the work; ``strict_types=True`` routes everything that is not
exactly a plain type (tuples, atoms, big integers, subclasses) through :meth:`_Pass.default`.
What it packs as an ext by itself (a ``msgpack.ExtType`` or ``msgpack.Timestamp`` in the
value) is refused: :mod:`~vllm_bridge.bridge.protocol.foreign` looks at the bytes of each
level packed.

Large tensors are never copied into the body. The packer is given a 16-byte token in their
place; the packed bytes are then split at each token into *segments*, and the tensor's own
memory becomes one segment, which :func:`~vllm_bridge.bridge.protocol.framing.write_segments`
hands to ``writev``. Tuples and dataclasses that contain large tensors are spliced the
same way, level by level, so no enclosing ext header ever carries a wrong length.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import struct
from collections.abc import Callable
from typing import Any, Union

import msgpack
import numpy as np
import torch

from vllm_bridge.bridge.protocol.foreign import holds_foreign, refusal
from vllm_bridge.bridge.protocol.registry import TypeRegistry
from vllm_bridge.bridge.protocol.slots import SlotDir, slot_payload
from vllm_bridge.bridge.protocol.tensors import can_encode, tensor_parts
from vllm_bridge.bridge.protocol.types import (
    BIGINT_MAX_BYTES,
    Atom,
    ExtCode,
    Ref,
    qualified_name,
)

Segment = Union[bytes, memoryview]
#: Turns an object that cannot travel by value into a reference (owned by a session).
MakeRef = Callable[[Any], Ref]

#: Tensors with at least this many data bytes are written from their own memory.
LARGE_TENSOR_BYTES = 64 * 1024

_TOKEN_LEN = 16
_FIXEXT = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}


def ext_header(code: int, length: int) -> bytes:
    """The msgpack header of an ext of ``length`` payload bytes (smallest form)."""
    fix = _FIXEXT.get(length)
    if fix is not None:
        return bytes((fix, code))
    if length < 0x100:
        return struct.pack(">BBb", 0xC7, length, code)
    if length < 0x10000:
        return struct.pack(">BHb", 0xC8, length, code)
    if length <= 0xFFFF_FFFF:
        return struct.pack(">BIb", 0xC9, length, code)
    raise ValueError(f"an ext payload of {length} bytes exceeds msgpack's 4 GiB limit")


def segments_length(segments: list[Segment]) -> int:
    """Total number of bytes in ``segments``."""
    return sum(s.nbytes if isinstance(s, memoryview) else len(s) for s in segments)


def bigint_payload(n: int) -> bytes:
    """The ext 7 payload of ``n``: a sign byte, then the magnitude big-endian. Raises
    :class:`TypeError` for a magnitude over :data:`BIGINT_MAX_BYTES` bytes."""
    mag = abs(n)
    size = (mag.bit_length() + 7) // 8
    if size > BIGINT_MAX_BYTES:
        raise TypeError(
            f"an integer of {mag.bit_length()} bits ({size} bytes) is over the protocol's "
            f"limit of {BIGINT_MAX_BYTES} bytes for a big integer (ext 7)"
        )
    return (b"\x01" if n < 0 else b"\x00") + mag.to_bytes(size, "big")


class Encoder:
    """Encodes values with the extension types of a :class:`TypeRegistry`."""

    def __init__(
        self,
        registry: TypeRegistry,
        large_tensor_bytes: int = LARGE_TENSOR_BYTES,
        slots: SlotDir | None = None,
    ):
        self.registry = registry
        self.large_tensor_bytes = large_tensor_bytes
        #: Where tensors of at least ``slots.min_bytes`` go (ext 8); None: the pipe.
        self.slots = slots

    def encode(
        self,
        value: Any,
        make_ref: MakeRef | None = None,
        check: Callable[[int], None] | None = None,
    ) -> list[Segment]:
        """Encode ``value`` into segments whose concatenation is one msgpack body.

        Args:
            value: Any value. Values with no by-value encoding become references.
            make_ref: Creates those references; without it they raise ``TypeError``.
            check: Called with the body's length once it is encoded, counting the data
                of the tensors it put in result slots (a reply is bounded by the frame
                limit whichever way its tensors travel, and the Elixir side refuses
                slots past it); what it raises (a reply over the frame limit) refuses
                the frame as a failed encode does.
        """
        p = _Pass(self, make_ref, value)
        try:
            segments = p.pack(value)
            if check is not None:
                check(segments_length(segments) + p.slot_bytes)
            return segments
        except BaseException:
            # The frame will not be sent: its result slots are free again.
            if self.slots is not None:
                for name in p.slots_written:
                    self.slots.give_back(name)
            raise

    def packb(self, value: Any, make_ref: MakeRef | None = None) -> bytes:
        """Encode ``value`` into one ``bytes`` body (copies large tensors)."""
        segments = self.encode(value, make_ref)
        if len(segments) == 1 and isinstance(segments[0], bytes):
            return segments[0]
        return b"".join(segments)


class _Pass:
    """State of one encode call: the large payloads replaced by tokens."""

    def __init__(self, encoder: Encoder, make_ref: MakeRef | None, root: Any) -> None:
        self.encoder = encoder
        #: The value encoded (a refusal names where in it the refused object sits).
        self.root = root
        #: The exts made so far at the level being packed (see :meth:`pack`).
        self.made = 0
        self.registry = encoder.registry
        self.make_ref = make_ref
        self.nonce = b""
        self.spliced: list[tuple[int, list[Segment]]] = []
        self.slots_written: list[str] = []
        #: The data bytes of the tensors written to result slots.
        self.slot_bytes = 0

    def pack(self, value: Any) -> list[Segment]:
        """One level: ``value`` packed, each ext in it made by :meth:`default` (an ext's
        payload is packed by a call of its own, one level down)."""
        outer = self.made  # (a failure ends the whole pass: nothing to restore then)
        self.made = 0
        data = msgpack.packb(value, default=self.default, strict_types=True, use_bin_type=True)
        made = self.made
        self.made = outer
        if holds_foreign(data, made, value):  # an ext msgpack wrote by itself (foreign.py)
            raise refusal(self.root)
        if not self.spliced:
            return [data]
        return self._splice(data)

    def ext(self, code: int, value: Any) -> msgpack.ExtType:
        """An ext whose payload is ``value`` packed (spliced when it holds large tensors)."""
        segments = self.pack(value)
        self.made += 1
        if len(segments) == 1 and isinstance(segments[0], bytes):
            return msgpack.ExtType(code, segments[0])
        return self._token(code, segments)

    def _token(self, code: int, segments: list[Segment]) -> msgpack.ExtType:
        if not self.nonce:
            self.nonce = os.urandom(8)
        self.spliced.append((code, segments))
        return msgpack.ExtType(code, self.nonce + struct.pack(">Q", len(self.spliced) - 1))

    def _splice(self, data: bytes) -> list[Segment]:
        out: list[Segment] = []
        start = 0
        view = memoryview(data)
        while True:
            pos = data.find(self.nonce, start)
            if pos < 0 or pos + _TOKEN_LEN > len(data):
                break
            (index,) = struct.unpack_from(">Q", data, pos + 8)
            code = self.spliced[index][0] if index < len(self.spliced) else -1
            if pos < 2 or data[pos - 2] != _FIXEXT[_TOKEN_LEN] or data[pos - 1] != code:
                start = pos + 1  # the nonce bytes occur by chance inside a value
                continue
            segments = self.spliced[index][1]
            if pos - 2 > start:
                out.append(view[start : pos - 2])
            out.append(ext_header(code, segments_length(segments)))
            out.extend(segments)
            start = pos + _TOKEN_LEN
        if start < len(data):
            out.append(view[start:])
        return out

    def default(self, obj: Any) -> Any:  # noqa: C901 - one dispatch table, read top-down
        """Called by msgpack for every value that is not exactly a plain type."""
        if isinstance(obj, Atom):
            self.made += 1
            return msgpack.ExtType(ExtCode.ATOM, obj.encode())
        if isinstance(obj, Ref):
            return self.ext(
                ExtCode.REF, [obj.instance, obj.ref_id, obj.session, obj.type_name]
            )
        if isinstance(obj, enum.Enum):
            name = self.registry.name_of(type(obj))
            if name is not None:
                return self.ext(ExtCode.ENUM, [name, obj.name])
            return self.reference(obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            name = self.registry.name_of(type(obj))
            if name is not None:
                fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
                return self.ext(ExtCode.DATACLASS, [name, fields])
            return self.reference(obj)
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj) if can_encode(obj) else self.reference(obj)
        if isinstance(obj, msgpack.ExtType):  # a subclass (the class itself never gets here)
            raise refusal(self.root, obj)
        if isinstance(obj, tuple):
            return self.ext(ExtCode.TUPLE, list(obj))
        if (
            type(obj) is slice
            and obj.step is None
            and (obj.start is None or type(obj.start) is int)
            and (obj.stop is None or type(obj.stop) is int)
        ):
            # A plain slice(start, stop) travels as the pair (start, stop) (one way: a
            # pair arrives in Python as a tuple; UBatchSlice turns pairs into slices).
            return self.ext(ExtCode.TUPLE, [obj.start, obj.stop])
        if type(obj) is int:  # only big integers reach here
            payload = bigint_payload(obj)
            self.made += 1
            return msgpack.ExtType(ExtCode.BIGINT, payload)
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return float(obj)
        if isinstance(obj, str):
            return str(obj)
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return bytes(obj)
        if isinstance(obj, dict):
            return dict(obj)
        if isinstance(obj, list):
            return list(obj)
        if isinstance(obj, np.ndarray):
            return self.array(obj)
        if isinstance(obj, np.generic) and not isinstance(obj, (np.void, np.object_)):
            return obj.item()
        return self.reference(obj)

    def tensor(self, t: torch.Tensor) -> msgpack.ExtType:
        header, data = tensor_parts(t)
        self.made += 1
        slots = self.encoder.slots
        if slots is not None and data.nbytes >= slots.min_bytes:
            name = slots.write(data)
            if name is not None:  # else every result slot is lent: the pipe
                self.slots_written.append(name)
                self.slot_bytes += data.nbytes
                return msgpack.ExtType(ExtCode.SLOT_TENSOR, slot_payload(header, name))
        if data.nbytes >= self.encoder.large_tensor_bytes:
            return self._token(ExtCode.TENSOR, [header, data])
        return msgpack.ExtType(ExtCode.TENSOR, header + data.tobytes())

    def array(self, arr: np.ndarray) -> Any:
        try:
            t = torch.from_numpy(np.ascontiguousarray(arr))
        except (TypeError, ValueError):
            return self.reference(arr)
        return self.tensor(t) if can_encode(t) else self.reference(arr)

    def reference(self, obj: Any) -> Any:
        if self.make_ref is None:
            raise TypeError(
                f"a {qualified_name(type(obj))} cannot travel by value and no session "
                "is there to hold a reference to it"
            )
        return self.default(self.make_ref(obj))
