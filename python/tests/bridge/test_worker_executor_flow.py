"""The executor and a stream's flow control, in process, on a real pipe: who reads the
credit a stream waits for, and a stop or cancel that comes before the stream's flow exists.

The executor is driven as the worker drives it (a reading role shared between the
execution thread and the watcher), with a minimal frame handler: a ``credit`` frame grants
room to the running stream, any other frame is a stream request of its id.
"""

from __future__ import annotations

import os
import threading

import msgpack
import pytest

from vllm_bridge.bridge.protocol.framing import FrameReader, write_frame
from vllm_bridge.bridge.protocol.messages import Invoke
from vllm_bridge.bridge.worker.executor import Executor

WAIT_S = 10.0


class Harness:
    """An executor on a pipe whose requests (``["stream", id, chunks]``) are streams of
    ``chunks`` items, ``window`` items of room at the start."""

    def __init__(self, window: int, poll: float) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.sent: list[tuple[int, int]] = []
        self.readers: dict[int, threading.Thread] = {}  # id -> thread that read its last frame
        self.cond = threading.Condition()
        self.window = window
        self.executor = Executor(
            self._handle,
            lambda _req, _exc: None,
            self._write,
            self._on_frame,
            FrameReader(fd=self.read_fd),
            poll=poll,
        )
        self.executor.start()
        self.watcher = threading.Thread(target=self.executor.watch, daemon=True)
        self.watcher.start()

    def _on_frame(self, body) -> Invoke | None:
        msg = msgpack.unpackb(bytes(body))
        self.readers[msg[1]] = threading.current_thread()
        if msg[0] == "credit":  # as the worker does
            self.executor.grant(msg[1], msg[2])
            return None
        return Invoke("stream", msg[1], None, None, args=[msg[2]])

    def _handle(self, req: Invoke):
        flow = self.executor.open_flow(req, window=self.window)
        for i in range(req.args[0]):
            if not flow.take():
                return ("stopped", req.id)
            self._write(("chunk", req.id, i))
        return ("end", req.id)

    def _write(self, reply) -> None:
        with self.cond:
            self.sent.append(reply)
            self.cond.notify_all()

    def send(self, msg) -> None:
        write_frame(msgpack.packb(msg), self.write_fd)

    def wait_for(self, reply) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: reply in self.sent, WAIT_S):
                raise AssertionError(f"{reply} not sent within {WAIT_S} s; sent {self.sent}")

    def close(self) -> None:
        os.close(self.write_fd)  # EOF: the executor stops
        self.executor.thread.join(WAIT_S)
        self.watcher.join(WAIT_S)
        os.close(self.read_fd)


@pytest.fixture
def harness():
    made = []

    def make(**kw) -> Harness:
        h = Harness(**kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def test_a_stream_out_of_room_has_its_credit_read_without_waiting_for_the_watchers_looks(
    harness,
):
    # The watcher would look only once an hour: the credit is read because the stream,
    # about to wait for it, hands the reading role to the watcher at once.
    h = harness(window=2, poll=3600.0)
    h.send(["stream", 1, 6])
    h.wait_for(("chunk", 1, 1))
    assert ("chunk", 1, 2) not in h.sent  # out of room: it waits
    h.send(["credit", 1, 2])
    h.wait_for(("chunk", 1, 3))
    h.send(["credit", 1, 2])
    h.wait_for(("end", 1))
    assert [r for r in h.sent if r[0] == "chunk"] == [("chunk", 1, i) for i in range(6)]


def test_the_reading_role_comes_back_to_the_execution_thread_after_such_a_stream(harness):
    h = harness(window=1, poll=3600.0)
    h.send(["stream", 1, 3])
    h.wait_for(("chunk", 1, 0))
    h.send(["credit", 1, 5])  # read by the watcher, the stream waiting
    h.wait_for(("end", 1))
    assert h.readers[1] is not h.executor.thread
    # The execution thread takes the role back and reads requests itself again. (The
    # watcher may still read one that arrives while it hands the role over, so a few.)
    for rid in range(2, 50):
        h.send(["stream", rid, 1])
        h.wait_for(("end", rid))
        if h.readers[rid] is h.executor.thread:
            break
    else:
        raise AssertionError("the watcher kept the reading role")


def test_a_flow_opened_after_the_executor_stopped_is_stopped_at_once():
    r, w = os.pipe()
    try:
        ex = Executor(lambda _r: None, lambda _r, _e: None, lambda _x: None,
                      lambda _b: None, FrameReader(fd=r))
        ex.stop()  # as on EOF, before the stream got as far as its flow
        flow = ex.open_flow(Invoke("stream", 7, None, None), window=4)
        assert flow.take() is False
    finally:
        os.close(r)
        os.close(w)


def test_a_flow_opened_for_a_cancelled_stream_is_stopped_at_once():
    r, w = os.pipe()
    try:
        ex = Executor(lambda _r: None, lambda _r, _e: None, lambda _x: None,
                      lambda _b: None, FrameReader(fd=r))
        req = Invoke("stream", 8, None, None)
        req.cancelled = True
        assert ex.open_flow(req).take() is False
        live = Invoke("stream", 9, None, None)
        flow = ex.open_flow(live)
        assert live.flow is flow and flow.take() is True
    finally:
        os.close(r)
        os.close(w)


def test_a_stream_waits_for_credit_only_while_nothing_is_queued(harness):
    h = harness(window=1, poll=3600.0)
    h.send(["stream", 1, 4])
    h.wait_for(("chunk", 1, 0))
    # A request queued behind the stream lets it run on without credit.
    h.send(["stream", 2, 4])
    h.wait_for(("end", 1))
    h.wait_for(("chunk", 2, 0))  # nothing queued behind this one: it waits for credit
    assert ("chunk", 2, 1) not in h.sent
    h.send(["credit", 2, 3])
    h.wait_for(("end", 2))
