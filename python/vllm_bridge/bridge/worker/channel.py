"""The worker's output: frames to fd 4, written whole under one lock, and ``log`` frames
for Python logging records.

Both threads write (the reader answers ``ping`` and refusals, the execution thread sends
replies), and so may any thread that logs; the lock keeps every frame in one piece. When
the peer is gone (the pipe is broken) nobody can hear the worker any more, so it exits.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from threading import get_ident
from typing import Any

from vllm_bridge.bridge.protocol.encoder import Encoder, MakeRef, Segment, segments_length
from vllm_bridge.bridge.protocol.errors import simple_error
from vllm_bridge.bridge.protocol.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    WRITE_FD,
    FrameTooLarge,
    check_max_frame,
    frame_bytes,
    write_all,
    write_segments,
)

#: The replies :meth:`Channel.hold` keeps at most, and the largest body it keeps.
HOLD_MAX = 32
HOLD_MAX_BYTES = 4096


class Channel:
    """Writes messages as frames of at most ``max_frame`` bytes to ``fd``."""

    def __init__(
        self, encoder: Encoder, fd: int = WRITE_FD, max_frame: int = DEFAULT_MAX_FRAME_BYTES
    ) -> None:
        self.encoder = encoder
        self.fd = fd
        #: The largest body a frame may have (``--max-frame-bytes``); a larger one is
        #: refused with :class:`~vllm_bridge.bridge.protocol.framing.FrameTooLarge`, unwritten.
        self.max_frame = check_max_frame(max_frame)
        self._lock = threading.Lock()
        # The thread writing a frame now (under the lock), or None: what ``writing`` asks.
        # An attribute, not a threading.local (two stores per frame cost half as much).
        self._writer: int | None = None
        # Small replies held to go out with the next write (hold/flush), whole frames.
        self._held: list[bytes] = []
        #: Set once the peer is known to be gone: writes are dropped from then on.
        self.closed = False

    def close(self) -> None:
        """Drop every later write (the port is gone; shutdown must not stop on EPIPE)."""
        self.closed = True

    def send(self, msg: Any, make_ref: MakeRef | None = None) -> None:
        """Encode ``msg`` (outside the lock) and write it as one frame."""
        self.write(self.encoder.encode(msg, make_ref))

    def write(self, segments: list[Segment]) -> None:
        """Write one frame made of ``segments``; exit the process if the peer is gone
        (unless :meth:`close` was called: then the frame is dropped).

        Raises:
            FrameTooLarge: the frame is over ``max_frame`` bytes (nothing is written).
        """
        if self.closed:
            return
        with self._lock:
            self._writer = get_ident()
            try:
                if self._held:
                    # Held replies go first, so frames keep the order they were made in;
                    # with a small frame, in the same write.
                    held, self._held = self._held, []
                    if len(segments) == 1 and type(segments[0]) is bytes:
                        if len(segments[0]) < HOLD_MAX_BYTES:
                            held.append(frame_bytes(segments[0]))
                            write_all(self.fd, b"".join(held))
                            return
                    write_all(self.fd, b"".join(held))
                write_segments(segments, self.fd, self.max_frame)
            except (BrokenPipeError, ConnectionResetError):
                if not self.closed:
                    _peer_gone()
            finally:
                self._writer = None

    def hold(self, segments: list[Segment]) -> bool:
        """Keep a small reply to go out with the next write instead of writing it now
        (the execution thread, when the next request is already read: a burst of
        requests is answered in one write and one wake-up of the reader, not one each):
        True when held; False for a reply that must be written now (over
        :data:`HOLD_MAX_BYTES`, not one ``bytes``, or :data:`HOLD_MAX` held already).
        What is held goes out at the next :meth:`write` (any thread's, before its own
        frame) or :meth:`flush`."""
        if (
            len(segments) != 1
            or type(segments[0]) is not bytes
            or len(segments[0]) >= HOLD_MAX_BYTES
            or len(self._held) >= HOLD_MAX
        ):
            return False
        frame = frame_bytes(segments[0])
        with self._lock:
            self._held.append(frame)
        return True

    def flush(self) -> None:
        """Write the held replies now, if any (one write)."""
        if not self._held or self.closed:
            return
        with self._lock:
            if not self._held:
                return
            held, self._held = self._held, []
            self._writer = get_ident()
            try:
                write_all(self.fd, b"".join(held))
            except (BrokenPipeError, ConnectionResetError):
                if not self.closed:
                    _peer_gone()
            finally:
                self._writer = None

    @property
    def writing(self) -> bool:
        """True while the calling thread is writing a frame (a log call then must not)."""
        return self._writer == get_ident()

    def error(self, request_id: int | None, error_type: str, message: str) -> None:
        """Send an ``error`` reply with no Python exception behind it (cut to fit)."""
        self.write(self.encode_error(request_id, simple_error(error_type, message)))

    def encode_error(self, request_id: int | None, err: dict[str, Any]) -> list[Segment]:
        """``["error", request_id, err]`` encoded; an error whose message or traceback
        alone is over the frame limit is cut (``err`` too), so that the request still
        gets its answer (the smallest limit leaves room for the cut one)."""
        frame = self.encoder.encode(["error", request_id, err])
        size = segments_length(frame)
        if size <= self.max_frame:
            return frame
        cut = (
            f" [cut: the error reply was {size} bytes, over the frame limit of "
            f"{self.max_frame} bytes (max_frame_bytes)]"
        )
        err["message"] = err["message"][:2000] + cut
        if err.get("traceback") is not None:
            err["traceback"] = err["traceback"][-8000:]
        return self.encoder.encode(["error", request_id, err])


def _peer_gone() -> None:
    sys.stderr.write("vllm_bridge.bridge.worker: fd 4 is closed (the port is gone); exiting\n")
    sys.stderr.flush()
    os._exit(0)


_LEVELS = ((logging.ERROR, "error"), (logging.WARNING, "warning"), (logging.INFO, "info"))


def level_name(levelno: int) -> str:
    """The protocol's name for a logging level (critical counts as error)."""
    for threshold, name in _LEVELS:
        if levelno >= threshold:
            return name
    return "debug"


#: Characters of a logger's name a cut log frame keeps.
_NAME_LIMIT = 200


class LogFrameHandler(logging.Handler):
    """Sends each record as ``["log", level, logger_name, message]``; a record too large
    for one frame is cut to fit, and says so."""

    def __init__(self, channel: Channel, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        if self.channel.writing:
            return  # a record raised while writing a frame would split that frame
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            level = level_name(record.levelno)
            try:
                self.channel.send(["log", level, record.name, message])
            except FrameTooLarge as exc:
                name = str(record.name)[:_NAME_LIMIT]
                # A character is at most 4 bytes of UTF-8: this many always fit.
                keep = max(0, (self.channel.max_frame - len(name) * 4 - 512) // 4)
                note = (
                    f" [cut: the log record was {exc.length} bytes, over the frame limit "
                    f"of {self.channel.max_frame} bytes (max_frame_bytes)]"
                )
                self.channel.send(["log", level, name, message[:keep] + note])
        except Exception:
            self.handleError(record)
