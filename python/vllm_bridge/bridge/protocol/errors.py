"""Errors the bridge itself raises, and the error map that travels in an ``error`` reply.

Each :class:`BridgeError` subclass carries the wire ``type`` of docs/PROTOCOL.md. Any other
exception (raised by the code a call ran) travels as ``python_exception``.
"""

from __future__ import annotations

import builtins
import reprlib
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
    ``KeyboardInterrupt`` is on Ctrl-C; see :mod:`vllm_bridge.bridge.worker.interrupt`.

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
    module, name = getattr(cls, "__module__", None), getattr(cls, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(name, str):
        return safe_str(cls)  # a class that misnames itself
    if module == "builtins" and getattr(builtins, name, None) is cls:
        return name
    return f"{module}.{name}"


#: Characters of a value a message shows (values from the wire can be as long as a frame).
VALUE_LIMIT = 80

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxtuple, _SHORT.maxlist, _SHORT.maxdict = 3, 6, 6, 4
_SHORT.maxset = _SHORT.maxfrozenset = _SHORT.maxdeque = _SHORT.maxarray = 6
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = VALUE_LIMIT


def short_repr(value: object, limit: int = VALUE_LIMIT) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for messages, without making
    the whole repr of a long value first (a string or a buffer is cut before it is
    written; containers show their first items). Never raises."""
    try:
        if isinstance(value, (str, bytes, bytearray, memoryview)):
            head = value[:limit]
            text = repr(bytes(head) if isinstance(head, memoryview) else head)
            if len(head) == len(value) and len(text) <= limit + 3:
                return text
            unit = "characters" if isinstance(value, str) else "bytes"
            return f"{text[:limit]}... ({len(value)} {unit})"
        text = _SHORT.repr(value)
    except BaseException:  # noqa: BLE001 - a repr is the value's own code
        return f"<a {type(value).__name__}>"
    return text if len(text) <= limit + 3 else text[:limit] + "..."


def safe_str(value: object) -> str:
    """``str(value)``, or a stand-in naming why it failed: an exception's ``__str__`` is
    the raising code's, and may itself raise (the request must still be answered)."""
    try:
        return str(value)
    except BaseException as exc:  # noqa: BLE001 - whatever its __str__ raises
        try:
            why = f"{type(exc).__name__}: {str(exc)[:200]}"
        except BaseException:  # noqa: BLE001
            why = type(exc).__name__
        return f"<exception str() failed: {why}>"


def error_map(exc: BaseException, exc_id: int | None = None) -> dict[str, Any]:
    """The error map of an ``error`` reply for ``exc``; never raises (a message or a
    traceback that cannot be made is replaced by one that says so).

    Bridge errors carry their own type and no traceback; anything else is a
    ``python_exception`` with its Python type, the formatted traceback and ``exc_id``.
    """
    if isinstance(exc, BridgeError) and type(exc).error_type != "python_exception":
        return {
            "type": exc.error_type,
            "message": safe_str(exc),
            "python_type": None,
            "traceback": None,
            "exc_id": None,
        }
    try:
        tb = "".join(traceback.format_exception(exc))
    except BaseException as failed:  # noqa: BLE001 - a traceback is a courtesy
        tb = f"<traceback could not be formatted: {safe_str(failed)[:200]}>"
    return {
        "type": "python_exception",
        "message": safe_str(exc),
        "python_type": python_type_name(exc),
        "traceback": tb,
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
