"""Shared pytest fixtures and helpers: real worker processes over real pipes on fds 3/4,
the byte vectors of priv/protocol/vectors.txt, and exact value comparison.

:class:`WorkerProc` is a small synchronous client of the protocol: it encodes requests
with the package's own codec, reads frames with a time limit (a hung worker fails the test
instead of hanging it), keeps ``log`` frames apart, and sets aside frames that belong to
other requests until they are asked for.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import os
import signal
import select
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from vllm_bridge.bridge.protocol import Atom, Ref, packb, unpackb
from vllm_bridge.bridge.protocol.framing import read_frame, write_frame
from vllm_bridge.bridge.worker.interrupt import INTERRUPT_SIGNAL, Interrupter

#: Seconds a test waits for any one frame before it fails.
FRAME_WAIT = 60.0

_ids = itertools.count(1)


def next_id() -> int:
    """A request id not used before in this test run."""
    return next(_ids)


class WorkerCallError(Exception):
    """An ``error`` reply; ``error`` is the worker's error map."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error.get('type')}: {error.get('message')}")
        self.error = error


@dataclass
class WorkerProc:
    """A worker subprocess and the two pipe ends the test holds."""

    proc: subprocess.Popen
    to_worker: int  # we write here; the worker reads it as fd 3
    from_worker: int  # we read here; the worker writes it as fd 4
    hello: dict[str, Any] = field(default_factory=dict)
    logs: list[list[Any]] = field(default_factory=list)
    inbox: list[list[Any]] = field(default_factory=list)

    # -- raw frames ------------------------------------------------------------------------

    def send(self, msg: Any) -> None:
        """Encode ``msg`` with the package codec and send it as one frame."""
        write_frame(packb(msg), fd=self.to_worker)

    def send_raw(self, body: bytes) -> None:
        """Send ``body`` as one frame, unchanged."""
        write_frame(body, fd=self.to_worker)

    def recv_raw(self, timeout: float = FRAME_WAIT) -> bytes:
        """The next frame's body; fails the test after ``timeout`` seconds."""
        ready, _, _ = select.select([self.from_worker], [], [], timeout)
        if not ready:
            raise TimeoutError(f"no frame from the worker within {timeout} s")
        body = read_frame(fd=self.from_worker)
        if body is None:
            raise EOFError("the worker closed its output")
        return bytes(body)

    def recv(self, timeout: float = FRAME_WAIT) -> Any:
        """The next frame that is not a ``log`` frame, decoded."""
        while True:
            msg = unpackb(self.recv_raw(timeout))
            if isinstance(msg, list) and msg and msg[0] == "log":
                self.logs.append(msg)
                continue
            return msg

    def take(self, match: Callable[[Any], bool], timeout: float = FRAME_WAIT) -> Any:
        """The first frame (set aside or new) for which ``match`` is true."""
        for i, msg in enumerate(self.inbox):
            if match(msg):
                return self.inbox.pop(i)
        while True:
            msg = self.recv(timeout)
            if match(msg):
                return msg
            self.inbox.append(msg)

    def reply(self, request_id: int, timeout: float = FRAME_WAIT) -> Any:
        """The next frame about ``request_id``."""
        return self.take(
            lambda m: isinstance(m, list) and len(m) > 1 and m[1] == request_id, timeout
        )

    # -- requests --------------------------------------------------------------------------

    def request(self, msg: list[Any]) -> Any:
        """Send ``msg`` (its id is ``msg[1]``) and return the reply frame."""
        self.send(msg)
        return self.reply(msg[1])

    def call(
        self,
        module: str,
        path: str,
        *args: Any,
        session: str | None = None,
        timeout: int | None = 30_000,
        via: str = "call",
        **kwargs: Any,
    ) -> Any:
        """Run ``call`` (or ``via="enter"``) on a module target; the value, or
        WorkerCallError."""
        return self.invoke(["m", module, path], list(args), kwargs, session, timeout, via)

    def invoke(
        self,
        target: list[Any],
        args: list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        session: str | None = None,
        timeout: int | None = 30_000,
        kind: str = "call",
    ) -> Any:
        """Send a ``call``/``enter`` request; the reply's value, or WorkerCallError."""
        rid = next_id()
        reply = self.request([kind, rid, session, timeout, target, args or [], kwargs or {}])
        return _value(reply, rid)

    def get(self, target: list[Any], session: str | None = None) -> Any:
        """Send a ``get``; the value, or WorkerCallError."""
        rid = next_id()
        return _value(self.request(["get", rid, session, 30_000, target]), rid)

    def stream(self, target: list[Any], args: list[Any], session: str | None = None) -> list[Any]:
        """Run a ``stream`` to its end; the chunks, or WorkerCallError."""
        rid = next_id()
        self.send(["stream", rid, session, 30_000, target, args, {}])
        chunks = []
        while True:
            msg = self.reply(rid)
            if msg[0] == "chunk":
                chunks.append(msg[2])
            elif msg[0] == "end":
                return chunks
            else:
                _value(msg, rid)

    def ping(self) -> dict[str, Any]:
        """Send a ``ping``; the pong's status map."""
        rid = next_id()
        kind, got_id, status = self.request(["ping", rid])
        assert (kind, got_id) == ("pong", rid)
        return status

    def close(self) -> None:
        """Close both pipe ends (the worker sees EOF)."""
        for fd in (self.to_worker, self.from_worker):
            try:
                os.close(fd)
            except OSError:
                pass

    def stop(self) -> None:
        """Close the pipes and wait for the process (killing it if it does not exit)."""
        self.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def _value(reply: Any, rid: int) -> Any:
    if reply[0] == "ok" and reply[1] == rid:
        return reply[2]
    if reply[0] == "error" and reply[1] == rid:
        raise WorkerCallError(reply[2])
    raise AssertionError(f"unexpected reply to {rid}: {reply!r}")


def run_loop(worker: Any, stream: Path, out: Path) -> None:
    """Run a worker's execution loop in this process over the frames in the file
    ``stream`` until EOF, its replies written to the file ``out``."""
    worker.channel.fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    worker.executor._reader.fd = os.open(stream, os.O_RDONLY)
    try:
        worker.executor.run()
    finally:
        os.close(worker.executor._reader.fd)
        os.close(worker.channel.fd)


def split_frames(data: bytes) -> list[bytes]:
    """The bodies of the frames (4-byte big-endian length, then the body) in ``data``."""
    found, pos = [], 0
    while pos < len(data):
        (n,) = struct.unpack_from(">I", data, pos)
        found.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return found


def wire_fds(r_in: int, w_out: int) -> Callable[[], None]:
    """A ``preexec_fn`` that puts ``r_in`` on fd 3 and ``w_out`` on fd 4."""

    def wire() -> None:
        # Move both ends above 4 first so that neither dup2 clobbers the other.
        a = os.dup(r_in)
        while a < 5:
            a = os.dup(a)
        b = os.dup(w_out)
        while b < 5:
            b = os.dup(b)
        os.dup2(a, 3)
        os.dup2(b, 4)

    return wire


def spawn_worker(
    extra_args: list[str] | None = None,
    stderr: int | None = None,
    support: bool = False,
    env: dict[str, str] | None = None,
    stdout: int | None = None,
) -> WorkerProc:
    """Start ``python -m vllm_bridge.bridge.worker`` with its fds 3 and 4 wired to pipes
    (``stderr=subprocess.PIPE`` captures its log output, ``stdout=`` its stdout). ``support``: this directory is
    on the worker's PYTHONPATH, so that it can import (and allow-list) the test-support
    modules kept here; ``env``: more variables of the worker's environment."""
    worker_env = {**os.environ, **(env or {})}
    if support:
        paths = [str(Path(__file__).resolve().parent), worker_env.get("PYTHONPATH")]
        worker_env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    r_in, w_in = os.pipe()  # test -> worker
    r_out, w_out = os.pipe()  # worker -> test
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_bridge.bridge.worker", *(extra_args or [])],
        preexec_fn=wire_fds(r_in, w_out),
        pass_fds=(3, 4),
        close_fds=True,
        stderr=stderr,
        stdout=stdout,
        env=worker_env,
    )
    os.close(r_in)
    os.close(w_out)
    wp = WorkerProc(proc=proc, to_worker=w_in, from_worker=r_out)
    kind, hello = wp.recv()
    assert kind == "hello"
    wp.hello = hello
    return wp


@pytest.fixture
def worker() -> Iterator[WorkerProc]:
    """A fresh worker for one test."""
    wp = spawn_worker()
    try:
        yield wp
    finally:
        wp.stop()


@pytest.fixture
def slot_root(tmp_path: Path) -> Path:
    """A private slot directory (mode 0700), as the Elixir side makes one for its workers
    (test_protocol_slots*.py)."""
    root = tmp_path / "slots"
    root.mkdir(mode=0o700)
    root.chmod(0o700)
    return root


@pytest.fixture(scope="module")
def shared_worker() -> Iterator[WorkerProc]:
    """One worker for all tests of a module (tests must leave it serving)."""
    wp = spawn_worker()
    try:
        yield wp
    finally:
        wp.stop()


# -- vectors and exact comparison ------------------------------------------------------

VECTORS_FILE = Path(__file__).resolve().parents[3] / "priv" / "protocol" / "vectors.txt"


def load_vectors(path: Path = VECTORS_FILE) -> dict[str, bytes]:
    """``name -> body`` of every vector in the file (``#`` starts a comment)."""
    vectors: dict[str, bytes] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, hexbody = line.split()
        if name in vectors:
            raise ValueError(f"vector {name!r} appears twice in {path}")
        vectors[name] = bytes.fromhex(hexbody)
    return vectors


def float_bits(x: float) -> int:
    """The IEEE 754 bits of a float 64."""
    return struct.unpack(">Q", struct.pack(">d", x))[0]


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw little-endian element bytes of a tensor (works for bfloat16 too)."""
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a: Any, b: Any) -> bool:
    """Exact equality: same types all the way down, floats and tensors bit for bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return float_bits(a) == float_bits(b)
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and tuple(a.shape) == tuple(b.shape)
            and a.device == b.device
            and tensor_bytes(a) == tensor_bytes(b)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        if len(a) != len(b):
            return False
        keys_b = list(b)
        return all(
            same(ka, kb) and same(a[ka], b[kb]) for ka, kb in zip(list(a), keys_b)
        )
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, (enum.Enum, Atom, Ref, str, bytes, int, bool)) or a is None:
        return a == b
    raise TypeError(f"same() does not know how to compare {type(a)}")


@pytest.fixture
def interrupter() -> Iterator[Interrupter]:
    """This process's interrupter installed (the worker's cancel-in-place, tested in
    process), the signal's handler before it put back after."""
    before = signal.getsignal(INTERRUPT_SIGNAL)
    it = Interrupter()
    it.install()
    try:
        yield it
    finally:
        signal.signal(INTERRUPT_SIGNAL, before)
