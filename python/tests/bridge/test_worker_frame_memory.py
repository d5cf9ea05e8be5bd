"""What a large frame leaves behind in the worker's memory (docs/PROTOCOL.md, "Frame
size"): the buffer a large body is read into is kept for the next large frame only while
requests keep coming, and is dropped once the worker has been idle a while; a frame the
watcher read (during a long call) is not kept alive by the watcher until the next frame;
a refusal of a large body does not copy it.

Memory is read from the worker's ``/proc/<pid>/status`` (VmRSS); a release is waited for
with a generous deadline (the test asserts that it comes, never how soon).
"""

from __future__ import annotations

import struct
import subprocess
import sys
import time

import pytest
from conftest import WorkerProc, next_id

from vllm_bridge.bridge.protocol import packb

D = "vllm_bridge.bridge.diag"
MIB = 1 << 20
RELEASE_WAIT_S = 60.0

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def rss_mib(w: WorkerProc) -> float:
    with open(f"/proc/{w.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def big_call(rid: int, size: int, last: bytes = packb(1)) -> bytearray:
    """A call with a binary of ``size`` bytes and ``last`` as its arguments, of a function
    diag does not have: the body is read and decoded, the call refused at its target
    (nothing keeps the arguments: no exception of the call's own is kept), the reply
    small. Built in place (no copies in this process)."""
    head = (
        b"\x97" + packb("call") + packb(rid) + packb(None) + packb(60_000)
        + packb(["m", D, "nothing_here"]) + b"\x92\xc6" + struct.pack(">I", size)
    )  # fmt: skip
    tail = last + b"\x80"
    body = bytearray(len(head) + size + len(tail))
    body[: len(head)] = head
    body[len(body) - len(tail) :] = tail
    return body


def settles_below(w: WorkerProc, limit: float) -> float:
    """The worker's RSS once it is under ``limit`` MiB (fails after RELEASE_WAIT_S)."""
    end = time.monotonic() + RELEASE_WAIT_S
    while (rss := rss_mib(w)) >= limit:
        assert time.monotonic() < end, f"the worker still holds {rss:.0f} MiB (limit {limit:.0f})"
        time.sleep(0.2)
    return rss


def send_big(w: WorkerProc, size: int) -> int:
    rid = next_id()
    w.send_raw(bytes(big_call(rid, size)))
    kind, got, err = w.reply(rid)
    assert (kind, got, err["type"]) == ("error", rid, "bad_argument")
    return rid


def test_the_buffer_of_a_large_frame_goes_once_the_worker_is_idle(worker: WorkerProc) -> None:
    base = settles_below(worker, 1e9)
    send_big(worker, 160 * MIB)  # under the reader's 256 MiB reuse bound: kept
    rss = settles_below(worker, base + 60)
    assert worker.call(D, "add", 1, 2) == 3
    assert rss < base + 60


def test_a_frame_the_watcher_read_is_not_kept_by_it(worker: WorkerProc) -> None:
    """During a long call the watcher reads; a body over the reuse bound has a buffer of
    its own, which must go once its request is done, not when the next frame comes."""
    base = settles_below(worker, 1e9)
    sleeper = next_id()
    worker.send(["call", sleeper, None, 60_000, ["m", D, "sleep"], [4.0], {}])
    end = time.monotonic() + 30
    while worker.ping()["running"] != sleeper:  # answered by the watcher: it reads now
        assert time.monotonic() < end
    send_big(worker, 300 * MIB)
    assert worker.reply(sleeper)[:3] == ["ok", sleeper, 4.0]
    settles_below(worker, base + 60)
    assert worker.call(D, "add", 1, 2) == 3


#: Run in a fresh process (its peak RSS is its own): refuse a 48 MiB body whose last
#: argument is refused, and print by how many MiB the peak grew meanwhile.
_REFUSE_LARGE = """
import resource, struct, sys
from vllm_bridge.bridge.protocol import BadArgument, Decoder, packb
size = 48 << 20
head = (b"\\x97" + packb("call") + packb(1) + packb(None) + packb(60_000)
        + packb(["m", "vllm_bridge.bridge.diag", "echo"]) + b"\\x92\\xc6" + struct.pack(">I", size))
tail = b"\\x82\\x01\\xa1a\\xc3\\xa1b\\x80"  # %{1 => "a", true => "b"}, then kwargs %{}
body = bytearray(len(head) + size + len(tail))
body[: len(head)] = head
body[len(body) - len(tail):] = tail
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    Decoder().decode(body)
except BadArgument as exc:
    assert str(exc).startswith("could not decode args[1]: the map keys 1 and true"), exc
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(grown / 1024)
"""


def test_refusing_a_large_body_does_not_copy_it() -> None:
    """Finding where in a 48 MiB body the refused value is used to copy the body three
    times over (bytes(), msgpack's Unpacker, the large argument decoded again): the
    peak grew by 192 MiB. The walk now reads the body in place; what the refusal costs
    is the failed decode itself (the binary it had built)."""
    out = subprocess.run(
        [sys.executable, "-c", _REFUSE_LARGE], capture_output=True, text=True, check=True
    )
    grown = float(out.stdout)
    assert grown < 72, f"the peak grew by {grown:.0f} MiB while refusing a 48 MiB body"
