"""Large tensors taken straight out of a large frame, with one copy each.

Decoding a tensor through msgpack costs two copies of its data: msgpack hands the ext
payload to the hook as a new ``bytes`` object, and the tensor data inside it is never
aligned for its dtype (it starts ``3 + len(device) + 8 * ndim`` bytes into the payload),
so :func:`~vllm_bridge.bridge.protocol.tensors.decode_tensor` copies it again. For a 64 MiB
tensor each copy is a fresh 64 MiB allocation.

For frames of at least :data:`SPLICE_MIN_FRAME` bytes, :func:`splice_tensors` first walks
the msgpack structure (without decoding it) to find tensors (ext 3) of at least
:data:`SPLICE_MIN_TENSOR` bytes that are elements of arrays or maps, copies each one once
from the frame into aligned memory, and returns the frame with each such tensor replaced
by a 16-byte token (ext 3 holding a random nonce and an index). The decoder then decodes
that small frame and maps each token to its tensor; this is the mirror image of how
:mod:`~vllm_bridge.bridge.protocol.encoder` splices large tensors into outgoing frames.

Tensors nested inside another extension value (a tuple, a dataclass) are left to the
plain path, and so is any frame the walk does not understand (malformed, or with more
than :data:`MAX_WALK` values): msgpack then decodes it, and reports its errors, as before.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import torch

from vllm_bridge.bridge.protocol.tensors import tensor_from_payload
from vllm_bridge.bridge.protocol.types import ExtCode

__all__ = ["SPLICE_MIN_FRAME", "SPLICE_MIN_TENSOR", "Spliced", "splice_tensors"]

#: Frames shorter than this are decoded by msgpack alone.
SPLICE_MIN_FRAME = 1 << 20
#: Tensors (ext payloads) shorter than this stay in the frame.
SPLICE_MIN_TENSOR = 1 << 16
#: Values the walk may visit before it gives up on a frame (a frame with that many values
#: is not dominated by a few large tensors).
MAX_WALK = 4096

TOKEN_LEN = 16
_FIXEXT16 = 0xD8

# Fixed sizes: first byte -> total bytes of the value (header included).
_FIXED = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9,
          0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}
# Length-prefixed str/bin: first byte -> bytes of the length field.
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
# Ext with a length field: first byte -> bytes of the length field.
_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4}
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
_CONTAINER = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


@dataclass
class Spliced:
    """A frame with its large tensors taken out.

    Attributes:
        body: The frame, each large tensor replaced by a token.
        nonce: The 8 random bytes every token of this frame starts with.
        tensors: The tensors, by token index.
    """

    body: bytes
    nonce: bytes
    tensors: list[torch.Tensor]

    def lookup(self, payload: bytes) -> torch.Tensor | None:
        """The tensor a token stands for, or ``None`` when ``payload`` is no token."""
        if len(payload) != TOKEN_LEN or payload[:8] != self.nonce:
            return None
        (index,) = struct.unpack_from(">Q", payload, 8)
        return self.tensors[index] if index < len(self.tensors) else None


def _uint(view: memoryview, pos: int, size: int) -> int:
    return int.from_bytes(view[pos : pos + size], "big")


def _find_tensors(view: memoryview) -> list[tuple[int, int, int]] | None:
    """``(value_start, payload_start, payload_len)`` of each large top-level tensor, or
    ``None`` when the frame is not one value the walk understands."""
    end = len(view)
    pos, pending, visited = 0, 1, 0
    found: list[tuple[int, int, int]] = []
    while pending:
        if pos >= end or visited >= MAX_WALK:
            return None
        pending -= 1
        visited += 1
        b = view[pos]
        if b <= 0x7F or b >= 0xE0:
            pos += 1
        elif b <= 0x8F:
            pending += 2 * (b & 0x0F)
            pos += 1
        elif b <= 0x9F:
            pending += b & 0x0F
            pos += 1
        elif b <= 0xBF:
            pos += 1 + (b & 0x1F)
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED:
            n = _SIZED[b]
            pos += 1 + n + _uint(view, pos + 1, n)
        elif b in _CONTAINER:
            n, per = _CONTAINER[b]
            pending += per * _uint(view, pos + 1, n)
            pos += 1 + n
        elif b in _EXT:
            n = _EXT[b]
            length = _uint(view, pos + 1, n)
            payload = pos + 2 + n
            code = int.from_bytes(view[pos + 1 + n : payload], "big", signed=True)
            if code == ExtCode.TENSOR and length >= SPLICE_MIN_TENSOR:
                found.append((pos, payload, length))
            pos = payload + length
        elif b in _FIXEXT:
            pos += 2 + _FIXEXT[b]
        else:  # 0xC1 is never used
            return None
    return found if pos == end else None


def splice_tensors(data: bytes | bytearray | memoryview) -> Spliced | None:
    """Take the large tensors out of ``data`` (see the module docstring); ``None`` when
    the frame is short, holds none, or is not understood.

    Raises:
        BadArgument: a large tensor's header is malformed (as decoding it would).
    """
    if len(data) < SPLICE_MIN_FRAME:
        return None
    view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
    found = _find_tensors(view)
    if not found:
        return None
    nonce = os.urandom(8)
    parts: list[bytes | memoryview] = []
    tensors = []
    pos = 0
    for index, (start, payload, length) in enumerate(found):
        tensors.append(tensor_from_payload(view[payload : payload + length]))
        parts.append(view[pos:start])
        parts.append(bytes((_FIXEXT16, ExtCode.TENSOR)) + nonce + struct.pack(">Q", index))
        pos = payload + length
    parts.append(view[pos:])
    return Spliced(b"".join(parts), nonce, tensors)
