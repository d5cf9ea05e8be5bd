"""Errors the bridge itself raises, and the error map that travels in an ``error`` reply.

Each :class:`BridgeError` subclass carries the wire ``type`` of docs/PROTOCOL.md. Any other
exception (raised by the code a call ran) travels as ``python_exception``.
"""

from __future__ import annotations

import builtins
import traceback
from typing import Any, ClassVar


class BridgeError(Exception):
    """Base of the errors the bridge raises; ``error_type`` is the wire ``type``."""

    error_type: ClassVar[str] = "python_exception"


class BadArgument(BridgeError, ValueError):
    """A value refused at the boundary: wrong type, unknown class, a foreign reference,
    a target outside the allow-list, the reference bound reached."""

    error_type = "bad_argument"


class ProtocolError(BridgeError, ValueError):
    """An undecodable frame, an unknown message kind or a malformed message."""

    error_type = "protocol"


class SessionLost(BridgeError):
    """A reference from an earlier worker process (its instance does not match)."""

    error_type = "session_lost"


class Cancelled(BridgeError):
    """The request was cancelled: before it started, or while it ran (a stream between two
    chunks, a call interrupted by :class:`CallInterrupted`)."""

    error_type = "cancelled"


class DeadlineExceeded(BridgeError):
    """The call's deadline had passed before it could start."""

    error_type = "timeout"


class CallInterrupted(BaseException):
    """Raised inside the code a request runs when its caller gave up (a ``cancel``), as
    ``KeyboardInterrupt`` is on Ctrl-C; see :mod:`vllm_bridge.worker.interrupt`.

    A ``BaseException``, so that user code's ``except Exception`` lets it through. The
    worker answers the request with the wire type ``cancelled`` (it turns the exception
    into :class:`Cancelled` where the user's code returns to it). ``token`` identifies
    the request's interruptible part that raised it.
    """

    def __init__(self, message: str, token: object = None) -> None:
        super().__init__(message)
        self.token = token


def python_type_name(exc: BaseException) -> str:
    """The exception's class as the wire names it: bare for builtins, else module.QualName."""
    cls = type(exc)
    if cls.__module__ == "builtins" and getattr(builtins, cls.__qualname__, None) is cls:
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def error_map(exc: BaseException, exc_id: int | None = None) -> dict[str, Any]:
    """The error map of an ``error`` reply for ``exc``.

    Bridge errors carry their own type and no traceback; anything else is a
    ``python_exception`` with its Python type, the formatted traceback and ``exc_id``.
    """
    if isinstance(exc, BridgeError) and type(exc).error_type != "python_exception":
        return {
            "type": exc.error_type,
            "message": str(exc),
            "python_type": None,
            "traceback": None,
            "exc_id": None,
        }
    return {
        "type": "python_exception",
        "message": str(exc),
        "python_type": python_type_name(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "exc_id": exc_id,
    }


def simple_error(error_type: str, message: str) -> dict[str, Any]:
    """An error map with no Python exception behind it."""
    return {
        "type": error_type,
        "message": message,
        "python_type": None,
        "traceback": None,
        "exc_id": None,
    }
