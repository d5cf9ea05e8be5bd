"""Shared pytest fixtures: start a real worker process over real pipes on fds 3/4."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

import msgpack
import pytest

from vllm_bridge.protocol.framing import read_frame, write_frame


@dataclass
class WorkerProc:
    """A worker subprocess and the two pipe ends the test holds."""

    proc: subprocess.Popen
    to_worker: int  # we write here; the worker reads it as fd 3
    from_worker: int  # we read here; the worker writes it as fd 4
    hello: dict[str, Any] = field(default_factory=dict)

    def send(self, msg: Any) -> None:
        write_frame(msgpack.packb(msg, use_bin_type=True), fd=self.to_worker)

    def send_raw(self, body: bytes) -> None:
        write_frame(body, fd=self.to_worker)

    def recv(self) -> Any:
        body = read_frame(fd=self.from_worker)
        assert body is not None, "worker closed its output"
        return msgpack.unpackb(body, raw=False)

    def close(self) -> None:
        for fd in (self.to_worker, self.from_worker):
            try:
                os.close(fd)
            except OSError:
                pass


def spawn_worker(extra_args: list[str] | None = None) -> WorkerProc:
    """Start ``python -m vllm_bridge.worker`` with its fds 3 and 4 wired to pipes."""
    r_in, w_in = os.pipe()  # test -> worker
    r_out, w_out = os.pipe()  # worker -> test

    def wire() -> None:
        # Move both ends above 4 first so that neither dup2 clobbers the other.
        a = os.dup(r_in) if r_in < 5 else r_in
        while a < 5:
            a = os.dup(a)
        b = os.dup(w_out)
        while b < 5:
            b = os.dup(b)
        os.dup2(a, 3)
        os.dup2(b, 4)

    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_bridge.worker", *(extra_args or [])],
        preexec_fn=wire,
        pass_fds=(3, 4),
        close_fds=True,
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
    wp = spawn_worker()
    try:
        yield wp
    finally:
        wp.close()
        try:
            wp.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            wp.proc.kill()
            wp.proc.wait()
