"""What each request does, on the execution thread, inside its session's context.

``call``/``get``/``stream``/``enter`` resolve a target, build the arguments (references
resolved, registered dataclasses built, atoms turned into enum members by annotation),
run the code and reply; ``exit``, ``release`` and ``close`` manage the session. Every
failure becomes an ``error`` reply: a Python exception never stops the worker.

The request's own code (the call it makes, each ``next()`` of a stream) runs under its
:class:`~vllm_bridge.bridge.worker.interrupt.Interruptible`, so that a cancel interrupts it
there and nowhere else (never in ``__enter__`` or ``__exit__``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from msgpack import packb as _packb

from vllm_bridge.bridge.protocol.encoder import Segment
from vllm_bridge.bridge.protocol.errors import (
    BadArgument,
    BridgeError,
    Cancelled,
    error_map,
    simple_error,
)
from vllm_bridge.bridge.protocol.flow import Flow
from vllm_bridge.bridge.protocol.foreign import ForeignValue
from vllm_bridge.bridge.protocol.materialize import materialize_field
from vllm_bridge.bridge.protocol.messages import Abandon, Close, Exit, Invoke, Release, Request
from vllm_bridge.bridge.protocol.registry import TypeRegistry
from vllm_bridge.bridge.protocol.types import Ref, qualified_name
from vllm_bridge.bridge.worker.channel import Channel
from vllm_bridge.bridge.worker.coerce import coerce_arguments
from vllm_bridge.bridge.worker.guard_messages import spot
from vllm_bridge.bridge.worker.interrupt import Interrupter, Interruptible
from vllm_bridge.bridge.worker.sessions import CONTEXT_TYPE, EnteredContext, Session, Sessions
from vllm_bridge.bridge.worker.targets import TargetResolver

_log = logging.getLogger("vllm_bridge.bridge.worker")

#: Why a callable argument is judged as a call, in the message that refuses one.
_PASSED = " (nor pass as an argument: the code it is passed to may call it)"

#: An encoded reply, ready for :meth:`Channel.write`.
Frame = list[Segment]


class Dispatcher:
    """Runs requests against the sessions of one worker and sends their replies."""

    def __init__(
        self,
        sessions: Sessions,
        resolver: TargetResolver,
        registry: TypeRegistry,
        channel: Channel,
        open_flow: Callable[[Request], Flow],
        interrupter: Interrupter | None = None,
    ) -> None:
        self.sessions = sessions
        self.resolver = resolver
        self.registry = registry
        self.channel = channel
        #: Makes the flow control of a stream request (the worker passes the executor's
        #: :meth:`~vllm_bridge.bridge.worker.executor_control.ExecutorControl.open_flow`).
        self.open_flow = open_flow
        #: Interrupts the request's code when it is cancelled (one that is never
        #: installed interrupts nothing: a cancel only marks the request then).
        self.interrupter = interrupter if interrupter is not None else Interrupter()

    # -- entry points (execution thread) -------------------------------------------------

    def handle(self, req: Request) -> Frame | None:
        """Run ``req``; returns its final reply, encoded (chunks are sent on the way), or
        ``None`` when nothing is to be sent back (an :class:`Abandon`).

        Never raises: failures become the ``error`` reply.
        """
        if isinstance(req, (Invoke, Exit)):  # the common kinds first
            session = self.sessions.get(req.session)
        elif isinstance(req, Release):
            # A release never brings a session into being: one closed (or never used) has
            # nothing left to release, and must not come back empty, never to be closed.
            found = self.sessions.find(req.session)
            session = found if found is not None else Session(req.session)
        elif isinstance(req, Close):
            return self._close(req)
        elif isinstance(req, Abandon):
            self._abandon(req)
            return None
        else:
            session = self.sessions.get(req.session)
        return session.context.run(self._in_session, req, session)

    def refuse(self, req: Request, exc: BridgeError) -> Frame:
        """The error reply of a request that is not run (its deadline passed)."""
        return self.channel.encode_error(req.id, error_map(exc))

    def failed(self, req: Request, message: str) -> Frame:
        """The error reply of a request whose handling failed in the worker itself
        (:meth:`handle` raised after all): ``python_exception`` with ``message``."""
        return self.channel.encode_error(req.id, simple_error("python_exception", message))

    def close_all(self) -> tuple[int, int]:
        """Close every session as ``close`` does; returns (sessions, contexts exited)."""
        sessions = self.sessions.all()
        contexts = 0
        for session in sessions:
            self.sessions.pop(session.name)
            contexts += len(session.contexts)
            session.context.run(self._exit_all, session)
        return len(sessions), contexts

    # -- per kind ------------------------------------------------------------------------

    def _in_session(self, req: Request, session: Session) -> Frame:
        try:
            if isinstance(req, Invoke):
                return self._invoke(req, session)
            if isinstance(req, Exit):
                return self._exit(req, session)
            if isinstance(req, Release):
                return self._release(req, session)
            raise BadArgument(f"no handler for {req.kind} requests")
        except BaseException as exc:  # noqa: BLE001 - user code may raise SystemExit too
            return self._fail(req, session, exc)

    def _invoke(self, req: Invoke, session: Session) -> Frame:
        if req.target is None:
            raise BadArgument(f"{req.kind} {req.id} has no target")
        obj, where = self.resolver.resolve(req.target, self.sessions, session)
        if req.kind == "get":
            return self._reply(req, session, "ok", obj)
        args, kwargs = self._arguments(req, session)
        own = Interruptible(self.interrupter, req)  # the request's own code: cancel stops it
        if req.kind in ("stream", "enter") and not callable(obj) and not args and not kwargs:
            result = obj  # stream an iterator / enter a context manager held by reference
        else:
            if not callable(obj):
                raise BadArgument(
                    f"{where} is a {qualified_name(type(obj))}, not callable (read it with get)"
                )
            # What may be called is a positive rule (docs/SECURITY.md): only code defined
            # in an allow-listed module, or a listed method of a value type.
            calls = self.resolver.guard.calls
            if calls.passed.get(id(obj)) is not obj:  # a known function: passes
                calls.check(obj, where, args, kwargs)
            if args or kwargs:
                args, kwargs = coerce_arguments(obj, args, kwargs, where)
                result = own.call(obj, *args, **kwargs)
            else:
                result = own.call(obj)
        if req.kind == "call":
            return self._reply(req, session, "ok", result)
        if req.kind == "stream":
            return self._stream(req, session, result, where, own)
        return self._enter(req, session, result, where)

    def _arguments(self, req: Invoke, session: Session) -> tuple[list[Any], dict[str, Any]]:
        args, kwargs = req.args, req.kwargs
        if req.special:
            guard = self.resolver.guard

            def resolve(ref: Ref) -> Any:
                # Vetted when the reference was made; vetted again as it is used.
                where = f"argument reference {ref.ref_id} ({ref.type_name})"
                obj = guard.check(self.sessions.resolve(session, ref), where)
                if callable(obj):  # the code it is passed to may call it
                    guard.calls.check(obj, where, note=_PASSED)
                return obj

            args = materialize_field(args, "args", self.registry, resolve)
            kwargs = materialize_field(kwargs, "kwargs", self.registry, resolve)
        if kwargs:
            kwargs = {str(k): v for k, v in kwargs.items()}
        return args, kwargs

    def _stream(
        self, req: Invoke, session: Session, result: Any, where: str, own: Interruptible
    ) -> Frame:
        self.resolver.guard.check(result, f"the result of {where}")
        try:
            iterator = iter(result)
        except TypeError:
            raise BadArgument(
                f"{where} gave a {qualified_name(type(result))}, which is not iterable: "
                "stream needs a generator or an iterable"
            ) from None
        flow = self.open_flow(req)
        try:
            while True:
                # Room for the next chunk first (a consumer that reads slowly holds the
                # generator back), then the item.
                if req.cancelled or not flow.take():
                    raise Cancelled(f"stream {req.id} was cancelled")
                try:
                    item = own.call(next, iterator)
                except StopIteration:
                    break
                self.channel.write(self._reply(req, session, "chunk", item))
        except BaseException:
            close = getattr(iterator, "close", None)
            if close is not None:
                try:
                    close()
                except BaseException:  # noqa: BLE001
                    _log.warning("closing the generator of stream %s failed", req.id, exc_info=True)
            raise
        return self.channel.encoder.encode(["end", req.id])

    def _enter(self, req: Invoke, session: Session, manager: Any, where: str) -> Frame:
        self.resolver.guard.check(manager, f"the result of {where}")
        cls = type(manager)
        enter = getattr(cls, "__enter__", None)
        exit_ = getattr(cls, "__exit__", None)
        if enter is None or exit_ is None:
            raise BadArgument(
                f"{where} gave a {qualified_name(cls)}, which is not a context manager"
            )
        handle = self.sessions.new_ref(session, manager, CONTEXT_TYPE)
        try:
            value = enter(manager)
        except BaseException:
            self.sessions.drop(session, handle.ref_id)
            raise
        entered = EnteredContext(manager, exit_, req.id)
        if req.cancelled:
            # The caller gave up while __enter__ ran: it will never learn the handle, so
            # nobody could exit the context; leave it now, cleanly (nothing ran inside).
            # (A cancel that comes after this look finds the enter finished: its Abandon
            # exits the context then.)
            self.sessions.drop(session, handle.ref_id)
            self._call_exit(entered, None)
            raise Cancelled(
                f"enter {req.id} was cancelled while {where} was being entered; "
                "the context was exited again"
            )
        session.contexts[handle.ref_id] = entered
        try:
            return self._reply(req, session, "ok", [handle, value])
        except BaseException as exc:
            # The caller never learns the handle: leave the context now, failed.
            del session.contexts[handle.ref_id]
            self.sessions.drop(session, handle.ref_id)
            try:
                self._call_exit(entered, exc)
            except BaseException:  # noqa: BLE001
                _log.warning("exiting context %s failed", handle.ref_id, exc_info=True)
            raise

    def _exit(self, req: Exit, session: Session) -> Frame:
        if req.handle is None:
            raise BadArgument(f"exit {req.id} has no context handle")
        self.sessions.check(session, req.handle)
        entered = session.contexts.pop(req.handle.ref_id, None)
        if entered is None:
            raise BadArgument(
                f"reference {req.handle.ref_id} ({req.handle.type_name}) is not an entered "
                f"context of session {session.name!r}"
            )
        self.sessions.drop(session, req.handle.ref_id)
        exc = None if req.exc is None else self.sessions.caller_exception(session, req.exc)
        suppressed = self._call_exit(entered, exc)
        return self._reply(req, session, "ok", suppressed)

    @staticmethod
    def _call_exit(entered: EnteredContext, exc: BaseException | None) -> bool:
        if exc is None:
            return bool(entered.exit(entered.manager, None, None, None))
        try:
            return bool(entered.exit(entered.manager, type(exc), exc, exc.__traceback__))
        except BaseException as raised:
            if raised is exc:
                return False  # re-raised what it was given: not suppressed
            raise

    def _release(self, req: Release, session: Session) -> Frame:
        for ref in req.refs:
            self.sessions.check_owner(session, ref)
        released = 0
        for ref in req.refs:
            entered = session.contexts.pop(ref.ref_id, None)
            if entered is not None:
                self._exit_quietly(entered, ref.ref_id)
            released += self.sessions.drop(session, ref.ref_id)
        return self._reply(req, session, "ok", released)

    def _close(self, req: Close) -> Frame:
        session = self.sessions.pop(req.session)
        refs = contexts = 0
        if session is not None:
            refs, contexts = len(session.refs), len(session.contexts)
            session.context.run(self._exit_all, session)
        return self.channel.encoder.encode(["ok", req.id, {"refs": refs, "contexts": contexts}])

    def _abandon(self, req: Abandon) -> None:
        # The caller of enter ``req.id`` gave up after it had finished: it may never have
        # seen the handle, so the context is left now, cleanly, in its own session.
        for session in self.sessions.all():
            for ref_id, entered in list(session.contexts.items()):
                if entered.enter_id == req.id:
                    del session.contexts[ref_id]
                    self.sessions.drop(session, ref_id)
                    session.context.run(self._exit_quietly, entered, ref_id)
                    _log.info("exited context %s: the caller of enter %s gave up", ref_id, req.id)
                    return

    def _exit_all(self, session: Session) -> None:
        for ref_id, entered in reversed(list(session.contexts.items())):
            self._exit_quietly(entered, ref_id)
        session.contexts.clear()
        session.refs.clear()
        session.exceptions.clear()

    def _exit_quietly(self, entered: EnteredContext, ref_id: int) -> None:
        try:
            entered.exit(entered.manager, None, None, None)
        except BaseException:  # noqa: BLE001 - one failing __exit__ must not stop the rest
            _log.warning("exiting context %s failed", ref_id, exc_info=True)

    # -- replies -------------------------------------------------------------------------

    def _reply(self, req: Request, session: Session, kind: str, value: Any) -> Frame:
        """Encode ``[kind, id, value]``; references it needs are owned by ``session``.

        Every object that would become a reference passes the value guard first; if one
        is refused, or the reply cannot be encoded, or it is over the frame limit
        (``ValueError`` naming its size and the limit), the references made for it are
        dropped again.
        """
        t = type(value)
        if t is bool or t is float or t is str or value is None or (
            t is int and -(1 << 63) <= value < (1 << 64)
        ):
            # Plain msgpack and no reference: the encoder's machinery is not needed.
            body = _packb([kind, req.id, value], use_bin_type=True)
            if len(body) > self.channel.max_frame:
                self._check_size(len(body))
            return [body]
        return self._encode_reply(req, session, kind, value)

    def _encode_reply(self, req: Request, session: Session, kind: str, value: Any) -> Frame:
        """:meth:`_reply` without its fast path for a plain scalar: what that fast path
        must agree with."""
        created: list[int] = []
        guard = self.resolver.guard

        def make_ref(obj: Any) -> Ref:
            reason = guard.reason(obj)
            if reason is not None:  # the whole reply fails; its references are dropped
                raise guard.refusal(obj, _where(req, kind, value, obj), reason)
            ref = self.sessions.new_ref(session, obj)
            created.append(ref.ref_id)
            return ref

        try:
            # The size is checked inside the encode: a frame refused for it gives back
            # the result slots its tensors went into, as a failed encode does.
            segments = self.channel.encoder.encode(
                [kind, req.id, value], make_ref, self._check_size
            )
        except BaseException as exc:
            for ref_id in created:
                self.sessions.drop(session, ref_id)
            if isinstance(exc, ForeignValue):  # named as the guard names a value: in the reply
                raise TypeError(f"{_where(req, kind, value, exc.value)} is {exc.what}") from None
            raise
        return segments

    def _check_size(self, size: int) -> None:
        limit = self.channel.max_frame
        if size > limit:
            raise ValueError(
                f"a reply of {size} bytes (its result slots' data counted) exceeds the "
                f"frame limit of {limit} bytes (max_frame_bytes)"
            )

    def _fail(self, req: Request, session: Session, exc: BaseException) -> Frame:
        if isinstance(exc, BridgeError) and exc.error_type != "python_exception":
            err = error_map(exc)
        else:
            err = error_map(exc, self.sessions.record(session, exc))
        return self.channel.encode_error(req.id, err)


def _where(req: Request, kind: str, value: Any, obj: Any) -> str:
    """Where ``obj`` sits in the reply of ``kind`` to ``req`` whose value is ``value``, for
    a refusal's message (``obj`` ``None``: it was not found again)."""
    reply = f"{'a chunk of' if kind == 'chunk' else 'the reply to'} {req.kind} {req.id}"
    return f"a value inside {reply}" if obj is None else spot(value, obj, reply)
