"""A stand-in worker for handshake tests of the Elixir runtime (test/runtime/worker_test.exs).

The real worker cannot be made to speak another protocol version or to hang before its
handshake, so this one does, on purpose, as ``FAKE_WORKER_MODE`` says:

* ``version`` - announce protocol version 99, then wait for EOF on fd 3;
* ``silent``  - announce nothing and wait for EOF on fd 3;
* ``crash``   - exit with status 3 before any handshake.
"""

from __future__ import annotations

import os
import struct
import sys

import msgpack


def _write(body: bytes) -> None:
    os.write(4, struct.pack(">I", len(body)) + body)


def _wait_for_eof() -> None:
    while os.read(3, 65536):
        pass


def main() -> int:
    """Behave as ``FAKE_WORKER_MODE`` says."""
    mode = os.environ.get("FAKE_WORKER_MODE", "")
    if mode == "version":
        hello = {"protocol": 99, "pid": os.getpid(), "instance": "00" * 8}
        _write(msgpack.packb(["hello", hello]))
        _wait_for_eof()
        return 0
    if mode == "silent":
        _wait_for_eof()
        return 0
    if mode == "crash":
        return 3
    sys.stderr.write(f"runtime_fake_worker: unknown FAKE_WORKER_MODE {mode!r}\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
