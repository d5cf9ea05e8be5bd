"""Sessions: each has its own ``contextvars.Context``, references and entered contexts.

Only the execution thread changes sessions; the reader thread reads the counts for
``pong``. References are numbered across the whole process and bounded per worker.
"""

from __future__ import annotations

import contextvars
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_bridge.bridge.protocol.errors import BadArgument, SessionLost
from vllm_bridge.bridge.protocol.types import Ref, qualified_name

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
        while len(session.exceptions) > KEPT_EXCEPTIONS:
            session.exceptions.popitem(last=False)
        return exc_id

    def caller_exception(self, session: Session, error: dict[str, Any]) -> BaseException:
        """The exception to pass to ``__exit__`` for a caller's error map: the recorded
        one when the map's ``exc_id`` names one of ``session``'s, else a CallerError."""
        exc_id = error.get("exc_id")
        if type(exc_id) is int and exc_id in session.exceptions:
            return session.exceptions[exc_id]
        message = error.get("message")
        return CallerError(message if isinstance(message, str) else "the caller failed", error)


_MISSING = object()
