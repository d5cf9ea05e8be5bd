"""The Python half of bench/shm_proto/run.exs: a throwaway prototype (issue 19) that
measures what a 64 MiB tensor round trip through shared memory would cost, before the
bridge gets such a path. Not the bridge's code: no codec, no checks beyond the name's.

Reads ``{packet, 4}`` frames on fd 3, answers on fd 4. A frame is ``mode:arg``:

* ``fresh:NAME``  - a file NAME the BEAM wrote in DIR (argv[1]): map it, copy it into a
  new tensor, unlink it; write the tensor to a new file of its own, answer its name;
* ``slot:N``      - N bytes in the BEAM's slot file DIR/e.slot (kept, reused; mapped once): copy them
  into a new tensor; copy the tensor into this side's slot DIR/p.slot (kept, mapped
  once, grown as needed); answer N;
* anything else   - echoed as it is (the pipe floor, as bench/raw_echo.py).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import struct
import sys
import warnings

import torch

HEADER = struct.Struct(">I")
NAME = re.compile(r"^[ep]-[0-9a-f]{32}$")
warnings.simplefilter("ignore", UserWarning)  # frombuffer of a read-only mapping


def read_exact(fd: int, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            raise EOFError
        got += k
    return buf


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def map_file(path: str, size: int, write: bool) -> mmap.mmap:
    fd = os.open(path, (os.O_RDWR | os.O_CREAT if write else os.O_RDONLY) | os.O_NOFOLLOW, 0o600)
    try:
        if write and os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if write else 0))
    finally:
        os.close(fd)


def main() -> None:
    root = sys.argv[1]
    out_slot: mmap.mmap | None = None
    in_slot: mmap.mmap | None = None
    while True:
        try:
            (n,) = HEADER.unpack(read_exact(3, 4))
        except EOFError:
            return
        frame = bytes(read_exact(3, n))
        mode, _, arg = frame.partition(b":")
        if mode == b"fresh":
            name = arg.decode()
            if not NAME.match(name) or not name.startswith("e-"):
                raise ValueError(f"bad name {name!r}")
            path = os.path.join(root, name)
            size = os.stat(path, follow_symlinks=False).st_size
            m = map_file(path, size, write=False)
            os.unlink(path)
            t = torch.frombuffer(m, dtype=torch.uint8).clone()
            del m
            out = f"p-{secrets.token_hex(16)}"
            fd = os.open(os.path.join(root, out), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            write_all(fd, memoryview(t.numpy()))
            os.close(fd)
            reply = out.encode()
        elif mode == b"slot":
            size = int(arg)
            if in_slot is None or len(in_slot) < size:
                in_slot = map_file(os.path.join(root, "e.slot"), size, write=False)
            t = torch.frombuffer(in_slot, dtype=torch.uint8, count=size).clone()
            if out_slot is None or len(out_slot) < size:
                out_slot = map_file(os.path.join(root, "p.slot"), size, write=True)
            torch.frombuffer(out_slot, dtype=torch.uint8, count=size).copy_(t)
            reply = arg
        else:
            reply = frame
        write_all(4, HEADER.pack(len(reply)) + reply)


if __name__ == "__main__":
    main()
