"""Tensors on the wire (ext 3): a small binary header, then the raw little-endian elements.

Payload layout (docs/PROTOCOL.md)::

    u8  dtype code    u8  ndim    u8  device length L, then L bytes of device name
    ndim x u64 big-endian shape
    prod(shape) x itemsize bytes, C-contiguous, little-endian

Encoding never copies a contiguous CPU tensor: :func:`tensor_parts` returns the header and
a ``memoryview`` of the tensor's own memory. A CUDA tensor is copied to the host and a
non-contiguous one made contiguous (both copies are unavoidable).
"""

from __future__ import annotations

import struct
import sys
import warnings

import torch

from vllm_bridge.bridge.protocol.errors import BadArgument

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise RuntimeError("vllm_bridge's tensor codec needs a little-endian host")

#: dtype code -> torch dtype (the table of docs/PROTOCOL.md).
CODE_TO_DTYPE: dict[int, torch.dtype] = {
    0: torch.bool,
    1: torch.uint8,
    2: torch.int8,
    3: torch.int16,
    4: torch.int32,
    5: torch.int64,
    6: torch.float16,
    7: torch.bfloat16,
    8: torch.float32,
    9: torch.float64,
    10: torch.complex64,
    11: torch.complex128,
    12: torch.uint16,
    13: torch.uint32,
    14: torch.uint64,
}
DTYPE_TO_CODE: dict[torch.dtype, int] = {dt: code for code, dt in CODE_TO_DTYPE.items()}
_ITEMSIZE: dict[torch.dtype, int] = {
    dt: torch.empty((), dtype=dt).element_size() for dt in DTYPE_TO_CODE
}

_U64 = struct.Struct(">Q")


def can_encode(t: torch.Tensor) -> bool:
    """True when ``t`` can travel by value: a strided tensor of a dtype in the table."""
    return t.layout == torch.strided and t.dtype in DTYPE_TO_CODE and not t.is_meta


def tensor_parts(t: torch.Tensor) -> tuple[bytes, memoryview]:
    """The ext 3 payload of ``t`` as (header, data); ``data`` shares the tensor's memory.

    Raises:
        TypeError: ``t`` cannot travel by value (see :func:`can_encode`).
    """
    if not can_encode(t):
        raise TypeError(f"tensor of dtype {t.dtype} and layout {t.layout} has no wire encoding")
    device = "" if t.device.type == "cpu" else str(t.device)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    dev = device.encode()
    header = bytes((DTYPE_TO_CODE[t.dtype], t.dim(), len(dev))) + dev
    header += b"".join(_U64.pack(n) for n in t.shape)
    if t.numel() == 0:
        return header, memoryview(b"")
    raw = t.reshape(-1).view(torch.uint8).numpy()
    return header, memoryview(raw).cast("B")


def _parse_header(
    payload: bytes | memoryview, header_only: bool = False
) -> tuple[torch.dtype, list[int], int, int]:
    """``(dtype, shape, data_offset, data_bytes)`` of an ext 3 payload, checked.

    Raises:
        BadArgument: an unknown dtype code, a truncated header, or a data length that does
            not match the shape.
    """
    if len(payload) < 3:
        raise BadArgument(f"tensor payload of {len(payload)} bytes is shorter than its header")
    code, ndim, dev_len = payload[0], payload[1], payload[2]
    dtype = CODE_TO_DTYPE.get(code)
    if dtype is None:
        raise BadArgument(f"unknown tensor dtype code {code}")
    offset = 3 + dev_len + 8 * ndim
    if len(payload) < offset:
        raise BadArgument(
            f"tensor payload of {len(payload)} bytes is shorter than its {offset}-byte header"
        )
    try:
        bytes(payload[3 : 3 + dev_len]).decode()
    except UnicodeDecodeError as exc:
        raise BadArgument(f"tensor device name is not UTF-8: {exc}") from None
    shape = [_U64.unpack_from(payload, 3 + dev_len + 8 * i)[0] for i in range(ndim)]
    if any(n >= 1 << 63 for n in shape):
        raise BadArgument(f"tensor shape {shape} has a dimension beyond the int64 range")
    itemsize = _ITEMSIZE[dtype]
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * itemsize
    if header_only:
        if len(payload) != offset:
            raise BadArgument(f"tensor header of {len(payload)} bytes should be {offset}")
        return dtype, shape, offset, nbytes
    if len(payload) - offset != nbytes:
        raise BadArgument(
            f"tensor of shape {shape} and dtype {dtype} needs {nbytes} data bytes, "
            f"got {len(payload) - offset}"
        )
    return dtype, shape, offset, nbytes


def check_tensor_payload(payload: bytes | memoryview) -> None:
    """Nothing when :func:`decode_tensor` would take an ext 3 payload: what it checks,
    without building the tensor (the data is read where it lies).

    Raises:
        BadArgument: as :func:`decode_tensor` would.
    """
    dtype, shape, offset, nbytes = _parse_header(payload)
    if dtype == torch.bool and nbytes:
        _finish(_frombuffer(payload, nbytes, offset), dtype, shape)


def _finish(raw: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if dtype == torch.bool and bool((raw > 1).any()):
        raise BadArgument("bool tensor data holds a byte other than 0 or 1")
    return raw.view(dtype).reshape(shape)


def _frombuffer(buffer: bytes | memoryview, nbytes: int, offset: int) -> torch.Tensor:
    with warnings.catch_warnings():
        # A read-only buffer only this decode sees: sharing it is safe.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)


def decode_tensor(payload: bytes) -> torch.Tensor:
    """Build a CPU tensor from an ext 3 payload.

    The result owns aligned memory; when the payload's data happens to be aligned for its
    dtype, the tensor shares the payload's memory instead of copying it.

    Raises:
        BadArgument: an unknown dtype code, a truncated header, or a data length that does
            not match the shape.
    """
    dtype, shape, offset, nbytes = _parse_header(payload)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = _frombuffer(payload, nbytes, offset)
    if raw.data_ptr() % _ITEMSIZE[dtype]:
        raw = raw.clone()  # unaligned elements: copy into torch's aligned memory
    return _finish(raw, dtype, shape)


def tensor_from_payload(payload: memoryview) -> torch.Tensor:
    """Build a CPU tensor from an ext 3 payload that lies inside a larger buffer (a frame
    the caller may reuse): the data is copied once, into memory the tensor owns.

    Raises:
        BadArgument: as :func:`decode_tensor`.
    """
    dtype, shape, offset, nbytes = _parse_header(payload)
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        out.copy_(_frombuffer(payload, nbytes, offset))
    return _finish(out, dtype, shape)


def parse_slot_header(header: bytes) -> tuple[torch.dtype, list[int], int]:
    """``(dtype, shape, data_bytes)`` of the ext 3 header that starts an ext 8 payload
    (a tensor in a slot: :mod:`~vllm_bridge.bridge.protocol.slots`), checked.

    Raises:
        BadArgument: an unknown dtype code or a malformed header.
    """
    dtype, shape, _offset, nbytes = _parse_header(header, header_only=True)
    return dtype, shape, nbytes


def tensor_from_slot(raw: torch.Tensor, header: bytes) -> torch.Tensor:
    """The tensor of an ext 8 payload's header whose data ``raw`` (uint8, owned) was
    read from its slot.

    Raises:
        BadArgument: bool data holding a byte other than 0 or 1.
    """
    dtype, shape, _ = parse_slot_header(header)
    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    return _finish(raw, dtype, shape)
