"""Sessions: each has its own ``contextvars.Context``, references and entered contexts.

Only the execution thread changes sessions; the reader thread reads the counts for
``pong``. References are numbered across the whole process and bounded per worker.
"""

from __future__ import annotations

import contextvars
import dis
import inspect
import logging
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from vllm_bridge.bridge.protocol.errors import BadArgument, SessionLost
from vllm_bridge.bridge.protocol.types import Ref, qualified_name

_log = logging.getLogger(__name__)

#: How many recent exceptions each session keeps for ``exit`` (by ``exc_id``).
KEPT_EXCEPTIONS = 64

#: ``type_name`` of the handle of an entered context manager.
CONTEXT_TYPE = "context"


class CallerError(Exception):
    """Passed to ``__exit__`` when the Elixir caller failed with an error this worker
    did not raise itself (no known ``exc_id``): the caller's message, and its error map.
    """

    def __init__(self, message: str, error: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.error = dict(error or {})


@dataclass
class EnteredContext:
    """A context manager entered over the bridge, with the ``__exit__`` to call."""

    manager: Any
    exit: Callable[..., Any]
    #: Id of the ``enter`` request that entered it (a ``cancel`` of that id exits it).
    enter_id: int | None = None


@dataclass
class Session:
    """One session's state on this worker."""

    name: str | None
    context: contextvars.Context = field(default_factory=contextvars.Context)
    refs: dict[int, Any] = field(default_factory=dict)
    #: handle ref id -> entered context, in order of entry.
    contexts: dict[int, EnteredContext] = field(default_factory=dict)
    exceptions: OrderedDict[int, BaseException] = field(default_factory=OrderedDict)


class Sessions:
    """All sessions of a worker, the reference bound and the exception journal."""

    def __init__(self, instance: str, max_refs: int) -> None:
        self.instance = instance
        self.max_refs = max_refs
        self._sessions: dict[str | None, Session] = {}
        self._next_ref = 1
        self._next_exc = 1
        #: Exceptions recorded whose frames' locals are still to be let go
        #: (:meth:`release_locals`, once their request has ended).
        self._unreleased: list[BaseException] = []
        #: References held across all sessions.
        self.ref_count = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, name: str | None) -> Session:
        """The session called ``name``, created on first use."""
        session = self._sessions.get(name)
        if session is None:
            session = self._sessions[name] = Session(name)
        return session

    def find(self, name: str | None) -> Session | None:
        """The session called ``name`` if it exists (none is created)."""
        return self._sessions.get(name)

    def pop(self, name: str | None) -> Session | None:
        """Forget the session called ``name`` (its references stop counting)."""
        session = self._sessions.pop(name, None)
        if session is not None:
            self.ref_count -= len(session.refs)
        return session

    def all(self) -> list[Session]:
        """Every session, oldest first."""
        return list(self._sessions.values())

    # -- references ----------------------------------------------------------------------

    def new_ref(self, session: Session, obj: Any, type_name: str | None = None) -> Ref:
        """Hold ``obj`` in ``session`` and return its reference.

        Raises:
            BadArgument: the worker already holds ``max_refs`` references.
        """
        if self.ref_count >= self.max_refs:
            raise BadArgument(
                f"this worker holds {self.ref_count} references, its bound (--max-refs "
                f"{self.max_refs}); release references or close sessions before making a "
                f"reference to a {qualified_name(type(obj))}"
            )
        ref_id = self._next_ref
        self._next_ref += 1
        session.refs[ref_id] = obj
        self.ref_count += 1
        return Ref(self.instance, ref_id, session.name, type_name or qualified_name(type(obj)))

    def check_owner(self, session: Session, ref: Ref) -> None:
        """Refuse a reference that was not made for ``session`` by this process.

        Raises:
            SessionLost: the reference comes from an earlier worker process.
            BadArgument: it belongs to another session.
        """
        if ref.instance != self.instance:
            raise SessionLost(
                f"reference {ref.ref_id} ({ref.type_name}) comes from worker instance "
                f"{ref.instance!r}, but this worker is instance {self.instance!r}: the "
                "worker it lived in is gone"
            )
        if ref.session != session.name:
            raise BadArgument(
                f"reference {ref.ref_id} ({ref.type_name}) belongs to session "
                f"{ref.session!r}, not to session {session.name!r}"
            )

    def check(self, session: Session, ref: Ref) -> None:
        """Refuse a reference that is not ``session``'s or is no longer held.

        Raises:
            SessionLost: the reference comes from an earlier worker process.
            BadArgument: it belongs to another session, or was released.
        """
        self.check_owner(session, ref)
        if ref.ref_id not in session.refs:
            raise BadArgument(
                f"reference {ref.ref_id} ({ref.type_name}) of session {session.name!r} "
                "was released or never existed"
            )

    def resolve(self, session: Session, ref: Ref) -> Any:
        """The object ``ref`` stands for (see :meth:`check` for the refusals)."""
        self.check(session, ref)
        return session.refs[ref.ref_id]

    def drop(self, session: Session, ref_id: int) -> bool:
        """Drop one reference of ``session``; False when it was not held."""
        if session.refs.pop(ref_id, _MISSING) is _MISSING:
            return False
        self.ref_count -= 1
        return True

    # -- exceptions ----------------------------------------------------------------------

    def record(self, session: Session, exc: BaseException) -> int:
        """Keep ``exc`` (the last :data:`KEPT_EXCEPTIONS` per session) and return its id."""
        exc_id = self._next_exc
        self._next_exc += 1
        session.exceptions[exc_id] = exc
        self._unreleased.append(exc)
        while len(session.exceptions) > KEPT_EXCEPTIONS:
            session.exceptions.popitem(last=False)
        return exc_id

    def release_locals(self) -> None:
        """Lets go of the local variables of the frames the exceptions recorded since the
        last look went through (the execution thread, once their request has ended and its
        reply is out): the journal keeps each exception, its traceback's lines and its
        chain, not what its frames held.

        Through its traceback a kept exception keeps every frame it went through, and in
        CPython each of those keeps its caller (``f_back``) up to the frame that runs the
        request, with their locals once they end: the call's arguments, the request. A
        large tensor argument maps an argument slot, which goes back to the BEAM only
        once the tensor is gone (docs/PROTOCOL.md, "Tensors in slots"): 8 failed calls
        with large arguments held every argument slot of the BEAM (and their pages) for
        as long as the journal kept them. Frames still running (the thread's loop) are
        not touched, nor a suspended generator's (clearing it would close it).
        """
        while self._unreleased:
            try:
                _clear_frames(self._unreleased.pop())
            except Exception:  # noqa: BLE001 - the execution thread must go on serving
                _log.warning("letting go of a kept exception's frames failed", exc_info=True)

    def caller_exception(self, session: Session, error: dict[str, Any]) -> BaseException:
        """The exception to pass to ``__exit__`` for a caller's error map: the recorded
        one when the map's ``exc_id`` names one of ``session``'s, else a CallerError."""
        exc_id = error.get("exc_id")
        if type(exc_id) is int and exc_id in session.exceptions:
            return session.exceptions[exc_id]
        message = error.get("message")
        return CallerError(message if isinstance(message, str) else "the caller failed", error)


#: Code flags of the frames that may be suspended (a generator's, a coroutine's).
_SUSPENDABLE = (
    inspect.CO_GENERATOR
    | inspect.CO_COROUTINE
    | inspect.CO_ASYNC_GENERATOR
    | inspect.CO_ITERABLE_COROUTINE
)
_YIELD_VALUE = dis.opmap["YIELD_VALUE"]
_BEFORE_311 = sys.version_info < (3, 11)


def _clear_frames(exc: BaseException) -> None:
    """Clears the locals of the ended frames of ``exc``'s traceback and of the exceptions
    chained to it, and of their callers up to the first frame still running."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        pending += (e.__cause__, e.__context__)
        tb = e.__traceback__
        if tb is None:
            continue
        # (The traceback's head is its outermost frame: its callers follow from there.)
        caller = tb.tb_frame.f_back
        while tb is not None:
            _clear(tb.tb_frame)
            tb = tb.tb_next
        while caller is not None and _clear(caller):
            caller = caller.f_back


def _clear(frame: FrameType) -> bool:
    """Clears ``frame``'s locals unless it is a suspended generator's (clearing would close
    it: an exception caught inside a generator that lives on, re-raised elsewhere); False
    when it still runs."""
    if frame.f_code.co_flags & _SUSPENDABLE and _at_yield(frame):
        return True
    try:
        frame.clear()
    except RuntimeError:  # still running
        return False
    return True


def _at_yield(frame: FrameType) -> bool:
    """Whether a generator's (or coroutine's) ``frame`` is suspended: its last instruction
    is a yield (a finished one's is the raise, or a re-raise of its cleanup).

    Before 3.11 a frame paused in ``yield from`` or ``await`` has its last instruction
    before the yield (review finding: clearing it closed a live generator, and an
    asyncio task never ended), so there every generator's and coroutine's frame counts as
    suspended: a failure raised inside a generator keeps its locals on 3.10, the price of
    never closing one that lives on."""
    if _BEFORE_311:
        return True
    try:
        return frame.f_code.co_code[frame.f_lasti] == _YIELD_VALUE
    except (IndexError, TypeError):
        return True  # not known: left as it is


_MISSING = object()
