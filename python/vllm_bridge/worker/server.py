"""Worker loop: announce, then read a frame, decode, dispatch, encode, write a reply.

Exits with status 0 when fd 3 reaches EOF (the port closed), so no worker outlives the BEAM.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any

import msgpack

from vllm_bridge import PROTOCOL_VERSION, PUBLIC_MODULES
from vllm_bridge.protocol.framing import read_frame, write_frame


def _hello() -> list[Any]:
    import torch

    from vllm_bridge.diag import default_device

    return [
        "hello",
        {
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "device": default_device(),
        },
    ]


def _resolve(module: str, name: str) -> Any:
    if module not in PUBLIC_MODULES:
        raise PermissionError(f"module {module!r} is not in the worker's allow-list")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        if part.startswith("__"):
            raise PermissionError(f"attribute {part!r} of {module}.{name} is not reachable")
        obj = getattr(obj, part)
    return obj


def _handle(msg: Any) -> list[Any]:
    if not isinstance(msg, list) or len(msg) < 2:
        return ["error", None, {"type": "protocol", "message": f"not a message: {msg!r:.200}"}]
    kind, req_id = msg[0], msg[1]
    if kind == "call" and len(msg) == 7:
        _, _, _session, _timeout, target, args, kwargs = msg
        try:
            fn = _resolve(target[1], target[2])
            return ["ok", req_id, fn(*args, **kwargs)]
        except Exception as exc:  # a Python exception never takes the worker down
            return [
                "error",
                req_id,
                {
                    "type": "python_exception",
                    "message": str(exc),
                    "python_type": type(exc).__qualname__,
                    "traceback": traceback.format_exc(),
                },
            ]
    if kind == "ping":
        return ["pong", req_id, {}]
    return ["error", req_id, {"type": "protocol", "message": f"unknown message kind {kind!r}"}]


def main() -> int:
    write_frame(msgpack.packb(_hello(), use_bin_type=True))
    while True:
        body = read_frame()
        if body is None:
            return 0
        try:
            msg = msgpack.unpackb(body, raw=False)
        except Exception as exc:
            reply = ["error", None, {"type": "protocol", "message": f"undecodable frame: {exc}"}]
        else:
            reply = _handle(msg)
        write_frame(msgpack.packb(reply, use_bin_type=True))
