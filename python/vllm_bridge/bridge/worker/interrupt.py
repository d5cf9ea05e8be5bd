"""Cancel in place: the running request's code is interrupted, and the worker goes on.

A ``cancel`` of the running request makes the watcher send :data:`INTERRUPT_SIGNAL` to
the main thread (``signal.pthread_kill``), which runs requests. Its handler raises
:class:`~vllm_bridge.bridge.protocol.errors.CallInterrupted` there, the way Ctrl-C raises
``KeyboardInterrupt``: in a Python loop at the next bytecode boundary, and in a blocking
call (``time.sleep``, a lock or ``Event`` wait, a read), which the signal wakes with
``EINTR``. A signal is the one way to reach both: an asynchronous exception set from
another thread (``PyThreadState_SetAsyncExc``) is only seen between bytecodes, never
inside a wait. CPython runs signal handlers on the main thread only, hence requests run
there (see :mod:`vllm_bridge.bridge.worker.server`).

The handler raises only

* while the request's *own* code runs: :meth:`Interruptible.call` arms around the call
  the request makes (``obj(*args, **kwargs)``) and each ``next()`` of a stream's
  generator, nothing else (not ``__enter__``/``__exit__``: an interruption just after
  ``__enter__`` returned could not be told from one inside it, and the context would
  leak);
* when that request was cancelled (a cancel that came before its code started stops it
  as it starts);
* once per request: a second interruption could land in the code's own cleanup
  (``finally``, ``__exit__``), which must run undisturbed. Code that catches the
  exception and goes on runs on; the Elixir side's ``cancel_grace`` bounds it;
* never inside :mod:`logging`'s own code: raised between ``_acquireLock()`` (or a
  handler's ``acquire()``) and the ``try`` that releases it, it would leave that lock
  held, and the worker's next log call would wait for it for good. One that lands there
  is tried again a few milliseconds later (:meth:`Executor.interrupt_again`: only if the
  request is still the running one then), until it lands in the code's own frames.

Any other signal is a no-op (an interrupted read or wait is retried, PEP 475). Code in C
(a torch kernel, a C extension's loop) is interrupted only once it returns to Python. A
``log`` frame the code sends is never cut in half (:meth:`Interrupter.held`).

**EINTR.** The Python handler decides in Python, but the signal interrupts whatever
system call the thread is in at the C level, before the handler runs. The executor sends
it under its lock, and only while the cancelled request is still the running one (the
thread needs that lock to clear it and start the next). So the signal is pending on the
thread before the next request can start, and the kernel delivers it within
microseconds, while the thread is still finishing the cancelled request (its own code,
or the worker's own work after it, whose reads and writes retry, PEP 475): a C
extension's blocking call that does not retry on ``EINTR`` fails with its own error in
the cancelled request. The window in which it could land in the next request's blocking
call is the delivery itself; before, it was everything between the cancel's decision
and the kill, while the thread might already have started the next request.

Why a real-time signal: ``SIGUSR1``/``SIGUSR2`` are the signals applications and tools
reach for first; the real-time range is left to applications, and ``SIGRTMIN`` (Python's,
already above the ones the C library keeps for itself) is skipped too, being the first a
library would take. ``SIGUSR2`` where the platform has no real-time signals.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

from vllm_bridge.bridge.protocol.errors import CallInterrupted, Cancelled
from vllm_bridge.bridge.protocol.messages import Request

#: The signal that interrupts the running request (see the module's docstring for why).
INTERRUPT_SIGNAL: int = (
    int(signal.SIGRTMIN) + 3 if hasattr(signal, "SIGRTMIN") else int(signal.SIGUSR2)
)

T = TypeVar("T")

#: Seconds after which an interruption that landed inside :mod:`logging` is tried again.
RETRY_SECONDS = 0.005


def _in_logging(frame: FrameType) -> bool:
    """Whether ``frame`` (where the handler runs) is code of the logging package."""
    name = frame.f_globals.get("__name__")
    return isinstance(name, str) and (name == "logging" or name.startswith("logging."))


class Interruptible:
    """The interruptible part of one request: :meth:`call` runs the request's own code."""

    __slots__ = ("request", "fired", "_owner")

    def __init__(self, owner: Interrupter, request: Request) -> None:
        self.request = request
        #: The request was interrupted once already (it never is again).
        self.fired = False
        self._owner = owner

    def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, interruptible while it runs.

        Raises:
            Cancelled: the request was cancelled before ``fn`` started, or interrupted
                while it ran (then its result, if it had returned, is dropped: the
                caller gave up).
        """
        owner = self._owner
        # The outer try catches an interruption wherever it lands between arming and
        # disarming, the inner finally included: the handler may run anywhere in here,
        # also in this frame just after ``fn`` returned.
        try:
            try:
                owner._armed = self
                if self.request.cancelled and not self.fired:
                    owner._fire(self)
                return fn(*args, **kwargs)
            finally:
                owner._armed = None  # one store: from here on the handler does nothing
        except CallInterrupted as exc:
            if exc.token is not self:
                raise  # kept by the code from another request and raised again here
            raise Cancelled(str(exc)) from None


class _Held:
    """:meth:`Interrupter.held`: interruptions wait until the block ends."""

    __slots__ = ("_owner", "_counted")

    def __init__(self, owner: Interrupter) -> None:
        self._owner = owner
        self._counted = False

    def __enter__(self) -> None:
        owner = self._owner
        if threading.get_ident() == owner._target:  # only the main thread is interrupted
            owner._holds += 1
            self._counted = True

    def __exit__(self, *exc_info: object) -> None:
        if not self._counted:
            return
        owner = self._owner
        owner._holds -= 1
        if owner._holds == 0 and owner._pending:
            owner._pending = False
            own = owner._armed
            if own is not None and not own.fired and own.request.cancelled:
                owner._fire(own)


class Interrupter:
    """The handler of :data:`INTERRUPT_SIGNAL` and what it may interrupt now."""

    def __init__(self, signum: int = INTERRUPT_SIGNAL) -> None:
        self.signum = signum
        self._target: int | None = None  # the main thread's ident, once installed
        self._armed: Interruptible | None = None
        self._holds = 0
        self._pending = False  # an interruption came while held
        #: Signals the thread again later, if the request is still the running one then
        #: (the worker sets :meth:`Executor.interrupt_again`): an interruption that lands
        #: inside :mod:`logging` is deferred to it. Without it, it is raised there.
        self.again: Callable[[Request, float], None] | None = None

    def install(self) -> None:
        """Install the handler. On the main thread (only it runs Python's handlers), the
        thread that then runs the requests."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("the interrupt handler must be installed on the main thread")
        signal.signal(self.signum, self._on_signal)
        if hasattr(signal, "pthread_sigmask"):  # a parent may have left it blocked
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {self.signum})
        self._target = threading.get_ident()

    @property
    def installed(self) -> bool:
        """Whether :meth:`install` ran."""
        return self._target is not None

    def interrupt(self) -> None:
        """Signal the main thread (from any thread): it interrupts the armed request if
        that one is cancelled, else nothing happens. A no-op before :meth:`install`."""
        target = self._target
        if target is not None:
            signal.pthread_kill(target, self.signum)

    def held(self) -> _Held:
        """A block that an interruption does not cut (the writing of a ``log`` frame): one
        that comes meanwhile is raised when the block ends."""
        return _Held(self)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        own = self._armed
        if own is None or own.fired or not own.request.cancelled:
            return
        if self._holds:
            self._pending = True
            return
        if self.again is not None and frame is not None and _in_logging(frame):
            # Raised here, it could leave logging's module lock (or a handler's) held:
            # taken and not yet inside the try that releases it. Try again shortly,
            # once the code has left logging (under the executor's lock: only if the
            # request is still running then).
            self.again(own.request, RETRY_SECONDS)
            return
        self._fire(own)

    def _fire(self, own: Interruptible) -> None:
        own.fired = True
        req = own.request
        raise CallInterrupted(
            f"{req.kind} {req.id} was interrupted: its caller gave up on it (cancel)", own
        )
