"""What user code in a worker can send that the worker's own encoder never would, for
test/runtime/untrusted_frames_test.exs: the Python process runs user code, so the bytes
it writes are not to be trusted by the Elixir side.

* :func:`write_frame` writes a whole frame straight to the worker's output pipe (fd 4),
  beside the worker's own frames (call it while nothing else is in flight);
* :func:`forged_slot` answers its own call with an ext 8 (a tensor in a result slot)
  naming a sparse file of any declared size, made in the node's slot directory: it
  writes that reply itself (the worker's encoder refuses to send an ext it did not make),
  and the worker's own reply to the call comes after it, to no call;
* :func:`named_slot` answers its own call the same way, naming any slot (one of
  another worker, for test/runtime/slot_owner_test.exs) and making no file;
* :func:`forged_ext` returns a ``msgpack.ExtType`` of any code, which the worker's
  encoder refuses (python/vllm_bridge/bridge/protocol/foreign.py);
* :func:`refused_mix` returns a value holding real references and real result slots
  around a value the BEAM refuses (test/runtime/refused_reply_test.exs), with the
  worker's check for exts it did not make turned off, as hostile user code could.
"""

from __future__ import annotations

import os
import struct
import sys

import msgpack

#: Elements of each tensor :func:`refused_mix` returns: 1.2 MB of float32, over the
#: 1 MiB slot threshold (a result slot while the worker has one free).
MIX_NUMEL = 300_000
#: Magnitude bytes of the big integer :func:`refused_mix` returns: one past the cap the
#: BEAM decodes (the worker's encoder refuses a Python int that large, not this ExtType).
MIX_BIGINT_BYTES = 4097


class Held:
    """An object the wire has no encoding for: it travels as a reference the worker holds."""


def write_frame(body: bytes) -> int:
    """Write ``body`` as one frame (4-byte big-endian length, then the body) to fd 4;
    return its length."""
    if not isinstance(body, bytes):
        raise TypeError(f"body must be bytes, got {type(body).__name__}")
    data = memoryview(struct.pack(">I", len(body)) + body)
    while data:
        data = data[os.write(4, data) :]
    return len(body)


def forged_slot(nbytes: int, n: int) -> None:
    """Answer this call with a uint8 tensor of shape ``[nbytes]`` in the result slot
    ``r-<this pid>-<n>``: a sparse file of ``nbytes`` bytes (no pages written) in
    ``VLLM_BRIDGE_SHM_DIR``."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int of at least 0, got {nbytes!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int of at least 0, got {n!r}")
    name = f"r-{os.getpid()}-{n}"
    path = os.path.join(os.environ["VLLM_BRIDGE_SHM_DIR"], name)
    with open(path, "wb") as f:
        f.truncate(nbytes)
    named_slot(nbytes, name)


def named_slot(nbytes: int, name: str) -> None:
    """Answer this call with a uint8 tensor of shape ``[nbytes]`` in the slot ``name``,
    whatever that name is (another worker's ``r-<its pid>-<n>``, say): no file is made."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int of at least 0, got {nbytes!r}")
    if not isinstance(name, str) or not 0 < len(name.encode()) < 256:
        raise ValueError(f"name must be a str of 1 to 255 bytes, got {name!r}")
    # ext 3's header (dtype code 1 = uint8, ndim 1, no device, the shape), then the name.
    header = bytes([1, 1, 0]) + struct.pack(">Q", nbytes)
    slot = msgpack.ExtType(8, header + bytes([len(name)]) + name.encode())
    write_frame(msgpack.packb(["ok", _request_id(), slot]))


def forged_ext(code: int, where: str = "") -> object:
    """A ``msgpack.ExtType`` of ``code`` whose payload is a reference's
    (``[instance, ref_id, session, type_name]``), alone or (``where="nested"``) at
    ``["refs"][1]`` of a dict."""
    ext = msgpack.ExtType(code, msgpack.packb(["0123456789abcdef", 1, None, "builtins.dict"]))
    return {"refs": [0, ext]} if where == "nested" else ext


def _request_id() -> int:
    """The id of the request running this code, read from the worker's own frames (as any
    user code could)."""
    frame = sys._getframe(1)
    while frame is not None:
        req = frame.f_locals.get("req")
        if type(req).__name__ == "Invoke":
            return req.id
        frame = frame.f_back
    raise RuntimeError("not called by a worker's request")


def refused_mix(spec: object) -> object:
    """``spec`` with its leaves made real: ``"ref"`` a new :class:`Held` (a reference),
    ``"slot"`` a float32 tensor of :data:`MIX_NUMEL` elements (a result slot), and
    ``"refuse"`` an ext 7 of :data:`MIX_BIGINT_BYTES` magnitude bytes; lists, tuples and
    dicts are rebuilt around them, any other leaf is kept.

    The ext 7 is user code's own, which the worker's encoder refuses
    (vllm_bridge.bridge.protocol.foreign): this turns that check off for good in this
    worker process (the test's own pool), as hostile user code could, so that the BEAM's
    refusal of what a worker sends is what the test meets."""
    import torch

    from vllm_bridge.bridge.protocol import encoder

    encoder.holds_foreign = lambda data, made, value: False

    def build(x: object) -> object:
        if x == "ref":
            return Held()
        if x == "slot":
            return torch.ones(MIX_NUMEL, dtype=torch.float32)
        if x == "refuse":
            return msgpack.ExtType(7, b"\x00" + b"\x01" * MIX_BIGINT_BYTES)
        if isinstance(x, list):
            return [build(v) for v in x]
        if isinstance(x, tuple):
            return tuple(build(v) for v in x)
        if isinstance(x, dict):
            return {k: build(v) for k, v in x.items()}
        return x

    return build(spec)
