"""Diagnostics callable over the bridge: identity of the worker and tiny test functions.

These exist so that the plumbing (framing, codec, dispatch, sessions, streaming, context
managers, timeouts) can be exercised without the forward-context system:

* values: :func:`echo`, :func:`add`, :func:`to_device`, :class:`Level` (an enum), :class:`Sample` (a
  dataclass), :func:`level_name` (takes a ``Level``, so an atom is coerced to it);
* time: :func:`sleep` (a stand-in for a long forward pass), :func:`count` (a generator),
  :func:`spin` (a long loop in pure Python; a call stuck in C code, which a cancel cannot
  interrupt, is python/tests/bridge/cancel_support.py's ``stuck``: it blocks the worker's
  interrupt signal, which no caller of a public module may do);
* failures: :func:`fail` raises; :func:`opaque` returns an object that can only travel
  as a reference; :func:`log` logs a message;
* per-session state: :func:`set_var` / :func:`get_var` use a ``ContextVar``;
* context managers: :func:`recorder` returns one that writes how it was exited to a
  process-wide journal, read with :func:`exit_log`.
"""

from __future__ import annotations

import contextvars
import enum
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn


def info() -> dict[str, Any]:
    """Describe this worker process: OS pid, Python and torch versions, device."""
    import torch

    from vllm_bridge import PROTOCOL_VERSION

    return {
        "protocol": PROTOCOL_VERSION,
        "pid": os.getpid(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": default_device(),
    }


def default_device() -> str:
    """The device this worker computes on: ``cuda:N`` when CUDA is usable, else ``cpu``."""
    import torch

    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def to_device(tensor: Any, device: str | None = None) -> Any:
    """``tensor`` moved to ``device`` (default: this worker's :func:`default_device`);
    a stand-in for a forward pass whose output lives on the GPU."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    return tensor.to(device or default_device())


def echo(value: Any) -> Any:
    """Return ``value`` unchanged (a round trip through both codecs)."""
    return value


def thread_id() -> int:
    """The identity of the thread running this call (``threading.get_ident()``)."""
    return threading.get_ident()


def add(a: int | float, b: int | float) -> int | float:
    """Return ``a + b``."""
    return a + b


def sleep(seconds: float) -> float:
    """Sleep for ``seconds`` and return them; a stand-in for a long forward pass."""
    _check_seconds("seconds", seconds)
    time.sleep(seconds)
    return seconds


def spin(seconds: float, cleanup: float = 0.0, swallow: bool = False) -> int:
    """Loop in pure Python for ``seconds`` (a busy CPU, no blocking call); return the
    number of turns. A stand-in for Python code that runs long, which a cancel interrupts
    at its next bytecode (see docs/PROTOCOL.md, "Cancel").

    How it ends is recorded in :func:`exit_log` under ``"spin"`` (``type`` is that of
    the exception that ended it, ``None`` when it ran to its end).

    Args:
        seconds: How long to loop.
        cleanup: Seconds its ``finally`` clause then sleeps, as cleanup code would; once
            that is done, ``"spin cleanup"`` is recorded in :func:`exit_log` (a cleanup
            cut short records nothing).
        swallow: Catch whatever is raised inside the loop (the cancel's interruption
            included), record it under ``"spin swallowed"``, and loop on to the end, as
            code that catches ``BaseException`` would.
    """
    end = time.monotonic() + _check_seconds("seconds", seconds)
    cleanup = _check_seconds("cleanup", cleanup)
    outcome: BaseException | None = None
    try:
        while True:
            # The whole loop runs inside this try (a loop's own jump back is where Python
            # looks for pending signals): what ``swallow`` catches is caught wherever it
            # lands.
            try:
                return _spin_until(end)
            except BaseException as exc:  # noqa: BLE001 - what ``swallow`` stands for
                if not swallow:
                    raise
                _record("spin swallowed", exc)
    except BaseException as exc:
        outcome = exc
        raise
    finally:
        _record("spin", outcome)
        if cleanup:
            time.sleep(cleanup)
            _record("spin cleanup", None)


def _spin_until(end: float) -> int:
    turns = 0
    while time.monotonic() < end:
        turns += 1
    return turns


_LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def log(message: str, level: str = "warning") -> None:
    """Log ``message`` on the ``vllm_bridge.bridge.diag`` logger at ``level`` (``"debug"``,
    ``"info"``, ``"warning"`` or ``"error"``); a worker forwards those at or above its
    ``--log-level`` (default warning)."""
    levelno = _LOG_LEVELS.get(level)
    if levelno is None:
        raise ValueError(f"level must be one of {sorted(_LOG_LEVELS)}, got {level!r}")
    logging.getLogger(__name__).log(levelno, "%s", message)


def _check_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    return float(value)


class Level(enum.Enum):
    """A small enum for exercising enum values on the wire (ext 5)."""

    LOW = 1
    HIGH = 2


@dataclass
class Sample:
    """A small dataclass for exercising dataclass values on the wire (ext 4).

    Attributes:
        name: Any string.
        level: A :class:`Level`; an atom such as ``:high`` is accepted over the bridge.
        payload: Any value; one that cannot travel by value comes back as a reference.
    """

    name: str
    level: Level = Level.LOW
    payload: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"Sample.name must be a str, got {self.name!r}")
        if not isinstance(self.level, Level):
            raise TypeError(f"Sample.level must be a Level, got {self.level!r}")


def level_name(level: Level) -> str:
    """The name of ``level``; raises ``TypeError`` for anything but a :class:`Level`."""
    if not isinstance(level, Level):
        raise TypeError(f"level must be a Level, got {level!r}")
    return level.name


class Opaque:
    """An object of a class the wire has no encoding for, so it travels as a reference."""

    def __init__(self, value: Any = 0) -> None:
        self.value = value

    def bump(self, by: int = 1) -> Any:
        """Add ``by`` to ``value`` and return the new value."""
        self.value = self.value + by
        return self.value


def opaque(value: Any = 0) -> Opaque:
    """A new :class:`Opaque` holding ``value``."""
    return Opaque(value)


_FAILURES: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "RuntimeError": RuntimeError,
    "KeyError": KeyError,
}


def fail(message: str, kind: str = "ValueError") -> NoReturn:
    """Raise ``kind(message)``; ``kind`` is one of ValueError, TypeError, RuntimeError,
    KeyError."""
    cls = _FAILURES.get(kind)
    if cls is None:
        raise ValueError(f"kind must be one of {sorted(_FAILURES)}, got {kind!r}")
    raise cls(message)


_VAR: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "vllm_bridge.bridge.diag.var", default=None
)


def set_var(value: Any) -> Any:
    """Set this context's diagnostic variable to ``value``; return its previous value.

    Over the bridge, each session has its own ``contextvars.Context``, so the value is
    visible to later calls of the same session only.
    """
    previous = _VAR.get()
    _VAR.set(value)
    return previous


def get_var() -> Any:
    """This context's diagnostic variable (``None`` until :func:`set_var`)."""
    return _VAR.get()


_journal: list[dict[str, Any]] = []


def _record(name: str, exc: BaseException | None) -> None:
    _journal.append(
        {
            "name": name,
            "type": None if exc is None else f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": None if exc is None else str(exc),
        }
    )


def exit_log(clear: bool = False) -> list[dict[str, Any]]:
    """Exits recorded so far, oldest first: ``{"name", "type", "message"}`` each, where
    ``type`` is the exception's qualified class name (``None`` for a clean exit).

    Args:
        clear: Empty the journal after reading it.
    """
    entries = list(_journal)
    if clear:
        _journal.clear()
    return entries


class ExitRecorder:
    """A context manager that records how it was exited (see :func:`exit_log`).

    Like the forward context, it sets a ``ContextVar`` on entry (:func:`get_var` returns
    its name while it is entered) and resets it on exit, which only works in the context
    it was entered in: exited anywhere else, ``__exit__`` raises ``ValueError``.
    """

    def __init__(self, name: str, suppress: bool = False, enter_delay: float = 0.0) -> None:
        self.name = name
        self.suppress = suppress
        self.enter_delay = enter_delay
        self._token: contextvars.Token[Any] | None = None

    def __enter__(self) -> str:
        if self.enter_delay:
            time.sleep(self.enter_delay)
        self._token = _VAR.set(self.name)
        return self.name

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        _record(self.name, exc)
        if self._token is not None:
            token, self._token = self._token, None
            _VAR.reset(token)
        return self.suppress


def recorder(name: str, suppress: bool = False, enter_delay: float = 0.0) -> ExitRecorder:
    """A context manager entering as ``name`` that records its exit (see
    :class:`ExitRecorder`); it suppresses the exception it exits with when ``suppress``
    is true, and its ``__enter__`` sleeps ``enter_delay`` seconds first (a slow entry)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {name!r}")
    return ExitRecorder(name, bool(suppress), _check_seconds("enter_delay", enter_delay))


def count(n: int, delay: float = 0.0, name: str | None = None) -> Iterator[int]:
    """Yield ``0 .. n-1``, sleeping ``delay`` seconds before each; a stand-in stream.

    When ``name`` is given, the generator's end (exhausted, closed or failed) is recorded
    in :func:`exit_log` under that name (a close records ``builtins.GeneratorExit``).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    delay = _check_seconds("delay", delay)
    return _count(n, delay, name)


def _count(n: int, delay: float, name: str | None) -> Iterator[int]:
    outcome: BaseException | None = None
    try:
        for i in range(n):
            if delay:
                time.sleep(delay)
            yield i
    except BaseException as exc:
        outcome = exc
        raise
    finally:
        if name is not None:
            _record(name, outcome)
