"""A frame whose handling raises is answered, and the thread that read it reads on.

The worker's frame handlers answer their own errors (a refusal, or ``frame not handled``
from :meth:`Worker.on_frame`'s last guard), but a failure outside them, such as the
lane's check of the common call (which once raised OverflowError for a big-integer
timeout), took the execution thread down with the process. The executor and the watcher
now answer such a frame as :meth:`Worker.on_frame` does: an error of type ``protocol``
under the id read from the frame's first bytes (logged when it has none), and go on.
KeyboardInterrupt and SystemExit still go through.
"""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
from conftest import run_loop, split_frames

from vllm_bridge import PUBLIC_MODULES
from vllm_bridge.bridge.protocol import messages
from vllm_bridge.bridge.protocol.framing import FrameReader, write_frame
from vllm_bridge.bridge.protocol.messages import Invoke
from vllm_bridge.bridge.worker import lane as lane_module
from vllm_bridge.bridge.worker.executor import Executor
from vllm_bridge.bridge.worker.server import Worker

HEADER = struct.Struct(">I")
DIAG = "vllm_bridge.bridge.diag"
WAIT_S = 10.0


def run(tmp_path: Path, msgs: list[Any], lane: bool) -> list[Any]:
    """The replies of an in-process worker's execution loop to ``msgs`` (then EOF)."""
    stream, out = tmp_path / "frames", tmp_path / "replies"
    stream.write_bytes(b"".join(HEADER.pack(len(b)) + b for b in map(msgpack.packb, msgs)))
    run_loop(Worker(tuple(PUBLIC_MODULES), 8, lane=lane), stream, out)
    return [msgpack.unpackb(b, strict_map_key=False) for b in split_frames(out.read_bytes())]


@pytest.mark.parametrize("lane", [True, False])
def test_a_failure_in_parsing_on_the_execution_thread_is_answered_and_reading_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lane: bool
) -> None:
    # The common call's check fails for id 5 (the lane calls it, and parse_request).
    real = messages.plain_call

    def failing(msg: list[Any], now: float) -> Any:
        if msg[1] == 5:
            raise RuntimeError("injected parse failure")
        return real(msg, now)

    monkeypatch.setattr(lane_module, "plain_call", failing)
    monkeypatch.setattr(messages, "plain_call", failing)
    msgs = [
        ["call", 4, None, None, ["m", DIAG, "add"], [1, 1], {}],
        ["call", 5, None, None, ["m", DIAG, "add"], [1, 2], {}],
        ["call", 6, None, None, ["m", DIAG, "add"], [1, 3], {}],
        ["ping", 7],
    ]
    replies = run(tmp_path, msgs, lane)
    assert [r[:2] for r in replies] == [["ok", 4], ["error", 5], ["ok", 6], ["pong", 7]]
    assert replies[1][2]["type"] == "protocol"
    assert replies[1][2]["message"] == "frame not handled: injected parse failure"
    assert replies[2][2] == 4


class Harness:
    """An executor and its watcher on a pipe, with a frame handler that raises for a
    frame ``["boom", ...]`` and otherwise makes ``["sleep", id, s]`` a request of ``s``
    seconds; what the executor's ``unhandled`` gets is kept."""

    def __init__(self, raising: type[BaseException] = RuntimeError) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.raising = raising
        self.cond = threading.Condition()
        self.sent: list[Any] = []
        self.unhandled: list[tuple[bytes, BaseException, str]] = []
        self.executor = Executor(
            self._handle,
            lambda _req, _exc: None,
            self._write,
            self._on_frame,
            FrameReader(fd=self.read_fd),
            poll=0.001,
            unhandled=self._unhandled,
        )

    def _on_frame(self, body: Any) -> Invoke | None:
        msg = msgpack.unpackb(bytes(body))
        if msg[0] == "boom":
            raise self.raising(f"injected failure of frame {msg[1]}")
        return Invoke("call", msg[1], None, None, args=[msg[2]])

    def _handle(self, req: Invoke) -> Any:
        threading.Event().wait(req.args[0])
        return ("ok", req.id)

    def _write(self, reply: Any) -> None:
        with self.cond:
            self.sent.append(reply)
            self.cond.notify_all()

    def _unhandled(self, body: Any, exc: BaseException) -> None:
        self._write(("unhandled", msgpack.unpackb(bytes(body))[1]))
        self.unhandled.append((bytes(body), exc, threading.current_thread().name))

    def send(self, msg: Any) -> None:
        write_frame(msgpack.packb(msg), self.write_fd)

    def wait_for(self, reply: Any) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: reply in self.sent, WAIT_S):
                raise AssertionError(f"{reply} not sent within {WAIT_S} s; sent {self.sent}")

    def close(self) -> None:
        os.close(self.write_fd)
        self.executor.thread.join(WAIT_S)
        os.close(self.read_fd)


def test_the_executor_and_the_watcher_answer_a_frame_whose_handler_raised() -> None:
    h = Harness()
    thread = h.executor.start()
    watcher = threading.Thread(target=h.executor.watch, name="watcher", daemon=True)
    watcher.start()
    try:
        # Read by the execution thread (idle), then by the watcher (while 2 runs).
        h.send(["boom", 1])
        h.send(["sleep", 2, 1.0])
        h.wait_for(("unhandled", 1))
        h.send(["boom", 3])
        h.send(["sleep", 4, 0])
        h.wait_for(("ok", 4))
        assert h.sent == [("unhandled", 1), ("unhandled", 3), ("ok", 2), ("ok", 4)]
        readers = [name for _, _, name in h.unhandled]
        assert readers == [thread.name, "watcher"]
        assert all(isinstance(exc, RuntimeError) for _, exc, _ in h.unhandled)
    finally:
        h.close()
        watcher.join(WAIT_S)


@pytest.mark.parametrize("raising", [KeyboardInterrupt, SystemExit])
def test_a_keyboard_interrupt_or_exit_in_a_frame_handler_is_not_swallowed(
    raising: type[BaseException],
) -> None:
    h = Harness(raising)
    h.send(["boom", 1])
    h.send(["sleep", 2, 0])
    try:
        with pytest.raises(raising):
            h.executor.run()
        assert h.sent == [] and h.unhandled == []
    finally:
        os.close(h.write_fd)
        os.close(h.read_fd)
