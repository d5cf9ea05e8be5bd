"""The common call's lane: fewer Python-level steps for the request a worker sees most.

Most requests are a ``call`` of a function named by ``["m", module, name]`` with plain
arguments, read by the execution thread itself while it is idle. For those the general
path (:meth:`Worker.on_frame <vllm_bridge.bridge.worker.server.Worker.on_frame>`, then
:meth:`Dispatcher.handle <vllm_bridge.bridge.worker.dispatch.Dispatcher.handle>`) spends
more in its own layers than in decoding, calling and encoding
(bench/results/python-worker-second-pass.md). The lane does the same steps in fewer
frames:

* :meth:`CallLane.on_frame` (the execution thread's frames only: the watcher's go the
  general way) decodes with the decoder's own extension hook, map check and refusal of
  msgpack's timestamp, reusing one decoding pass, and checks the common call's shape
  inline. Anything else (another kind, a reference, dataclass or enum value, a frame
  large enough to splice, a malformed message) goes on to the general path *with what
  was decoded* (a slot tensor is read once), and a body that cannot be decoded is
  refused exactly as the general path refuses it (:meth:`Worker.undecodable`).
* The request is an ordinary :class:`~vllm_bridge.bridge.protocol.messages.Invoke` marked
  ``lane``: the executor begins, times out, cancels, hands the reading role over and
  answers it as any other (nothing of that is done here).
* :meth:`CallLane.handle` runs it in its session's context. A one-step name of a plain
  module whose object both the value guard and the call rule already passed (their
  ``passed`` tables: vetted, and dropped by them whenever what they decide on changes)
  is called under the request's :class:`~vllm_bridge.bridge.worker.interrupt.Interruptible`
  and a plain scalar result packed with a reused packer; anything else (another path, an
  object not yet vetted, a result that needs the encoder) is done by the dispatcher's own
  code, inside the same context.

A test runs generated requests through a worker with the lane and one without and
compares the replies (python/tests/bridge/test_lane.py).
"""

from __future__ import annotations

import sys
import time
import types
from typing import TYPE_CHECKING, Any

import msgpack

from vllm_bridge.bridge.protocol.decoder import Decoder, checked_dict, refuse_timestamps
from vllm_bridge.bridge.protocol.messages import Invoke, Request, plain_call
from vllm_bridge.bridge.worker.coerce import coerce_arguments
from vllm_bridge.bridge.worker.dispatch import Dispatcher, Frame
from vllm_bridge.bridge.worker.interrupt import Interruptible
from vllm_bridge.bridge.worker.sessions import Session

if TYPE_CHECKING:
    from vllm_bridge.bridge.worker.server import Worker

_ModuleType = types.ModuleType


class CallLane:
    """The lane of one worker (see the module's docstring)."""

    def __init__(self, worker: Worker, dispatcher: Dispatcher, decoder: Decoder) -> None:
        self._worker = worker
        self._dispatcher = dispatcher
        self._sessions = dispatcher.sessions
        resolver = dispatcher.resolver
        self._allowed = resolver.guard.allowed
        # Cleared in place (never replaced) by the guard and the call rule whenever what
        # they decide on changes: read here as the resolver and the dispatcher read them.
        self._guard_passed = resolver.guard.passed
        self._calls_passed = resolver.guard.calls.passed
        self._interrupter = dispatcher.interrupter
        self._channel = dispatcher.channel  # its max_frame read per reply, as _reply does
        # The execution thread's own decoding pass (the only thread that decodes with it).
        self._pass = decoder.small_pass()
        self._hook = self._pass.hook
        self._small = decoder.SMALL
        # One packer for every plain reply of the execution thread (packb makes one a call).
        self._pack = msgpack.Packer(use_bin_type=True).pack

    def on_frame(self, body: bytearray | memoryview) -> Request | None:
        """:meth:`Worker.on_frame` for a frame the execution thread read."""
        if len(body) >= self._small:
            return self._worker.on_frame(body)
        now = time.monotonic()
        p = self._pass
        p.special = False
        try:
            msg = msgpack.unpackb(
                body, strict_map_key=False, ext_hook=self._hook, object_pairs_hook=checked_dict
            )
            # Ext -1, which msgpack decodes without the hook: only a body with a byte 0xFF
            # can hold one (the reader's small bodies are bytearrays: `in` looks for the
            # int, 20 ns; the bytes b"\xff" take 0.29 us, as the common call's lane measured).
            if type(body) is not bytearray or 0xFF in body:
                refuse_timestamps(body, msg)
        except Exception as exc:  # noqa: BLE001 - refused as the general path refuses it
            return self._worker.undecodable(body, exc)
        if type(msg) is list and len(msg) == 7 and msg[0] == "call" and not p.special:
            # The same check parse_request's common path makes (one copy of it).
            req = plain_call(msg, now)
            if req is not None:
                req.lane = True
                return req
        return self._worker.on_value(body, msg, p.special, now)

    def handle(self, req: Request) -> Frame | None:
        """:meth:`Dispatcher.handle`, the lane's requests in fewer steps."""
        if type(req) is not Invoke or not req.lane:
            return self._dispatcher.handle(req)
        session = self._sessions.get(req.session)
        return session.context.run(self._in_session, req, session)

    def _in_session(self, req: Invoke, session: Session) -> Frame:
        target = req.target
        module, path = target.module, target.path  # type: ignore[union-attr]
        obj = sys.modules.get(module) if module in self._allowed else None
        fn: Any = None
        if (
            type(obj) is _ModuleType  # its attributes are its namespace's entries
            and "." not in path
            and path
            and not path.startswith("__")
        ):
            fn = obj.__dict__.get(path)
            if not (
                fn is not None
                and self._guard_passed.get(id(fn)) is fn
                and self._calls_passed.get(id(fn)) is fn
                and callable(fn)
            ):
                fn = None
        if fn is None:  # the resolver and the call rule decide, as for any call
            return self._dispatcher._in_session(req, session)
        try:
            own = Interruptible(self._interrupter, req)
            args, kwargs = req.args, req.kwargs
            if args or kwargs:
                args, kwargs = coerce_arguments(fn, args, kwargs, f"{module}.{path}")
                result = own.call(fn, *args, **kwargs)
            else:
                result = own.call(fn)
            t = type(result)
            if t is bool or t is float or t is str or result is None or (
                t is int and -(1 << 63) <= result < (1 << 64)
            ):
                body = self._pack(["ok", req.id, result])
                if len(body) > self._channel.max_frame:
                    self._dispatcher._check_size(len(body))
                return [body]
            return self._dispatcher._encode_reply(req, session, "ok", result)
        except BaseException as exc:  # noqa: BLE001 - as Dispatcher._in_session
            return self._dispatcher._fail(req, session, exc)
