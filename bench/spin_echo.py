"""An echo of {packet, 4} frames (fd 3 in, fd 4 out) for bench/vcpu_wakeups.exs: before it
waits for the next frame it may spin (ask the pipe without sleeping) for up to SPIN_US
microseconds, and before each reply it may busy-work for WORK_US microseconds, standing in
for a worker's own time on a call.

    python bench/spin_echo.py SPIN_US WORK_US
"""

import os
import select
import struct
import sys
import time

_HEADER = struct.Struct(">I")


def main() -> None:
    spin_s, work_s = (float(a) / 1e6 for a in sys.argv[1:3])
    buf = b""
    while True:
        if spin_s and not buf:
            end = time.monotonic() + spin_s
            while not select.select([3], [], [], 0)[0] and time.monotonic() < end:
                pass
        data = os.read(3, 65536)
        if not data:
            return
        buf += data
        while len(buf) >= 4:
            (n,) = _HEADER.unpack_from(buf)
            if len(buf) < 4 + n:
                break
            if work_s:
                until = time.perf_counter() + work_s
                while time.perf_counter() < until:
                    pass
            os.write(4, buf[: 4 + n])
            buf = buf[4 + n :]


if __name__ == "__main__":
    main()
