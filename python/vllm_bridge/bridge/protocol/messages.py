"""Requests from the Elixir side, checked field by field (docs/PROTOCOL.md, "Messages").

:func:`parse_request` turns a decoded body into one of the request dataclasses below or
raises :class:`~vllm_bridge.bridge.protocol.errors.ProtocolError` naming what is wrong; the error
carries the request id whenever one could be read, so the reply can name the call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm_bridge.bridge.protocol.errors import ProtocolError, short_repr
from vllm_bridge.bridge.protocol.types import Ref


class RequestError(ProtocolError):
    """A malformed request; ``request_id`` is its id when that could be read."""

    def __init__(self, message: str, request_id: int | None) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(slots=True)
class ModuleTarget:
    """``["m", module, path]``: an attribute path inside an allow-listed module."""

    module: str
    path: str


@dataclass(slots=True)
class RefTarget:
    """``["r", ref, path_or_nil]``: an attribute path of a referenced object."""

    ref: Ref
    path: str | None


Target = ModuleTarget | RefTarget


@dataclass(slots=True)
class Request:
    """Fields every request to the execution thread has."""

    kind: str
    id: int
    session: str | None
    #: ``time.monotonic()`` past which the request must not start; ``None``: no deadline.
    deadline: float | None
    #: Set by the reader thread when a ``cancel`` for this id arrives.
    cancelled: bool = field(default=False, compare=False)
    #: A stream's room (:class:`vllm_bridge.bridge.protocol.flow.Flow`), set when it starts.
    flow: Any = field(default=None, compare=False)


@dataclass(slots=True)
class Invoke(Request):
    """``call``, ``stream``, ``enter`` (with arguments) and ``get`` (without)."""

    target: Target | None = None
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: True when args or kwargs hold dataclass/enum values or references.
    special: bool = False
    #: The common call, taken by the worker's lane (:mod:`vllm_bridge.bridge.worker.lane`).
    lane: bool = False


@dataclass(slots=True)
class Exit(Request):
    """``exit``: leave an entered context; ``exc`` is nil or the caller's error map."""

    handle: Ref | None = None
    exc: dict[str, Any] | None = None


@dataclass(slots=True)
class Release(Request):
    """``release``: drop references of the session."""

    refs: list[Ref] = field(default_factory=list)


@dataclass(slots=True)
class Close(Request):
    """``close``: exit the session's contexts (newest first) and drop its references."""


@dataclass(slots=True)
class Abandon(Request):
    """Never on the wire: made by the worker from a ``cancel`` of an ``enter`` that had
    already finished. Its context is exited, if still entered, before any request that
    arrived after the ``cancel`` runs; nothing is sent back."""


@dataclass(slots=True)
class Control:
    """``ping``, ``cancel``, ``credit`` and ``hello``: handled by the reader thread at once."""

    kind: str
    id: int
    info: dict[str, Any] | None = None


#: The longest timeout, either way (ms): the BEAM's longest wait, 2^32 - 1 ms (about 49.7
#: days; @max_ms in lib/vllm_bridge/call/runtime.ex), more than the Elixir side sends.
#: Beyond it a number is refused, not made a deadline: a big integer (ext 7) does not fit
#: a float, an infinity is no deadline, and a huge negative one no different from -1.
MAX_TIMEOUT_MS = 4_294_967_295
# Its negative, made once (a large int negated per request is an allocation per request).
_MIN_TIMEOUT_MS = -MAX_TIMEOUT_MS

_ARITY = {
    "call": 7,
    "stream": 7,
    "enter": 7,
    "get": 5,
    "exit": 6,
    "release": 4,
    "close": 3,
    "cancel": 2,
    "credit": 3,
    "ping": 2,
    "hello": 3,
}


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def request_id_of(msg: Any) -> int | None:
    """The id of a message when it has a readable one (second element, an int >= 0)."""
    if isinstance(msg, list) and len(msg) >= 2 and _is_id(msg[1]):
        return msg[1]
    return None


_ARRAY_HEADERS = {0xDC: 2, 0xDD: 4}  # array 16 / array 32: bytes of the count
_STR_HEADERS = {0xD9: 1, 0xDA: 2, 0xDB: 4}  # str 8 / 16 / 32: bytes of the length
_UINT_SIZES = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


def peek_request_id(body: bytes | bytearray | memoryview) -> int | None:
    """The id of a request read from its first bytes, without decoding the rest.

    Every request starts ``[kind (str), id (uint), ...]``; this reads the array header,
    skips the kind and reads the id, so that a frame whose later values cannot be
    decoded at all (an unhashable map key, nesting past msgpack's limit, a malformed
    extension value) is still answered under its own id. ``None`` when the first bytes
    are not that shape.
    """
    data = memoryview(body).cast("B") if not isinstance(body, bytes) else body
    n = len(data)
    if n < 3:
        return None
    first = data[0]
    if 0x90 <= first <= 0x9F:
        count, pos = first & 0x0F, 1
    elif first in _ARRAY_HEADERS:
        size = _ARRAY_HEADERS[first]
        count, pos = int.from_bytes(data[1 : 1 + size], "big"), 1 + size
    else:
        return None
    if count < 2 or pos >= n:
        return None
    tag = data[pos]
    if 0xA0 <= tag <= 0xBF:
        pos += 1 + (tag & 0x1F)
    elif tag in _STR_HEADERS:
        size = _STR_HEADERS[tag]
        pos += 1 + size + int.from_bytes(data[pos + 1 : pos + 1 + size], "big")
    else:
        return None
    if pos >= n:
        return None
    tag = data[pos]
    if tag <= 0x7F:
        return tag
    size = _UINT_SIZES.get(tag)
    if size is None or pos + 1 + size > n:
        return None
    return int.from_bytes(data[pos + 1 : pos + 1 + size], "big")


def parse_request(msg: Any, now: float | None = None) -> Request | Control:
    """Check a decoded body and build its request.

    Args:
        msg: The decoded body.
        now: ``time.monotonic()`` at receipt (the deadline is fixed from it).

    Raises:
        RequestError: anything malformed; the message names the field and its value.
    """
    if type(msg) is list and len(msg) == 7 and msg[0] == "call":
        fast = plain_call(msg, time.monotonic() if now is None else now)
        if fast is not None:
            return fast
    return parse_checked(msg, now)


def parse_checked(msg: Any, now: float | None = None) -> Request | Control:
    """:func:`parse_request` without its fast path for the common ``call`` (every field
    checked on the way): what that fast path must agree with."""
    rid = request_id_of(msg)
    if not isinstance(msg, list) or not msg:
        raise RequestError(f"a message must be a non-empty array, got {short_repr(msg)}", None)
    kind = msg[0]
    if not isinstance(kind, str) or kind not in _ARITY:
        raise RequestError(f"unknown message kind {short_repr(kind, 60)}", rid)
    kind = str(kind)  # an atom arrives as a str subclass; kinds are plain str, as sessions
    if len(msg) != _ARITY[kind]:
        raise RequestError(
            f"a {kind} message has {_ARITY[kind] - 1} fields after the kind, got {len(msg) - 1}",
            rid,
        )
    if rid is None:
        raise RequestError(
            f"{kind} id must be a non-negative integer, got {short_repr(msg[1], 60)}", None
        )
    if kind in ("ping", "cancel"):
        return Control(kind, rid)
    if kind == "credit":
        n = msg[2]
        if not (_is_id(n) and n > 0):
            raise RequestError(f"credit n must be a positive integer, got {short_repr(n, 60)}", rid)
        return Control(kind, rid, {"n": n})
    if kind == "hello":
        if not isinstance(msg[2], dict):
            raise RequestError(f"hello info must be a map, got {short_repr(msg[2], 60)}", rid)
        return Control(kind, rid, msg[2])
    session = _session(msg[2], kind, rid)
    if kind == "close":
        return Close(kind, rid, session, None)
    if kind == "release":
        refs = msg[3]
        if not isinstance(refs, list) or not all(isinstance(r, Ref) for r in refs):
            raise RequestError(
                f"release refs must be an array of references, got {short_repr(refs)}", rid
            )
        return Release(kind, rid, session, None, refs=refs)
    deadline = _deadline(msg[3], kind, rid, time.monotonic() if now is None else now)
    if kind == "exit":
        handle, exc = msg[4], msg[5]
        if not isinstance(handle, Ref):
            raise RequestError(f"exit handle must be a reference, got {short_repr(handle)}", rid)
        if exc is not None and not isinstance(exc, dict):
            raise RequestError(f"exit exc must be nil or an error map, got {short_repr(exc)}", rid)
        return Exit(kind, rid, session, deadline, handle=handle, exc=exc)
    target = _target(msg[4], kind, rid)
    if kind == "get":
        return Invoke(kind, rid, session, deadline, target=target)
    args, kwargs = msg[5], msg[6]
    if not isinstance(args, list):
        raise RequestError(f"{kind} args must be an array, got {short_repr(args)}", rid)
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise RequestError(
            f"{kind} kwargs must be a map with str keys, got {short_repr(kwargs)}", rid
        )
    return Invoke(kind, rid, session, deadline, target=target, args=args, kwargs=kwargs)


def plain_call(msg: list[Any], now: float) -> Invoke | None:
    """The common ``call`` (a module target, plain field types) without the checks that
    name errors; ``None`` sends anything else through the full checks. (``msg``: a list
    of 7 whose first item is ``"call"``; also the worker's lane's check.)"""
    _, rid, session, timeout, target, args, kwargs = msg
    if (
        type(rid) is int
        and rid >= 0
        and (session is None or type(session) is str)
        and (
            timeout is None
            or (
                (type(timeout) is int or type(timeout) is float)
                and _MIN_TIMEOUT_MS <= timeout <= MAX_TIMEOUT_MS  # (False for NaN)
            )
        )
        and type(target) is list
        and len(target) == 3
        and target[0] == "m"
        and type(target[1]) is str
        and type(target[2]) is str
        and type(args) is list
        and type(kwargs) is dict
        and (not kwargs or all(type(k) is str for k in kwargs))
    ):
        deadline = None if timeout is None else now + timeout / 1000.0
        return Invoke(
            "call", rid, session, deadline, target=ModuleTarget(target[1], target[2]),
            args=args, kwargs=kwargs,
        )
    return None


def _session(value: Any, kind: str, rid: int) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return str(value)  # an atom arrives as a str subclass; sessions are plain str
    raise RequestError(f"{kind} session must be a str or nil, got {short_repr(value, 60)}", rid)


def _deadline(value: Any, kind: str, rid: int, now: float) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not _MIN_TIMEOUT_MS <= value <= MAX_TIMEOUT_MS  # NaN, too: never in range
    ):
        raise RequestError(
            f"{kind} timeout must be nil or a number of milliseconds of at most "
            f"{MAX_TIMEOUT_MS} either way, got {short_repr(value, 60)}",
            rid,
        )
    return now + value / 1000.0


def _target(value: Any, kind: str, rid: int) -> Target:
    if isinstance(value, list) and len(value) == 3:
        tag, first, path = value
        if tag == "m" and isinstance(first, str) and isinstance(path, str):
            return ModuleTarget(str(first), str(path))
        if tag == "r" and isinstance(first, Ref) and (path is None or isinstance(path, str)):
            return RefTarget(first, None if path is None else str(path))
    raise RequestError(
        f'{kind} target must be ["m", module, path] or ["r", ref, path_or_nil], '
        f"got {short_repr(value)}",
        rid,
    )
