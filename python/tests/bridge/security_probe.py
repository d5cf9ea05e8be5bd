"""A careless user module for the security tests (python/tests/bridge/test_security_*.py).

It is allow-listed in the tests' workers beside ``vllm_bridge.bridge.diag``, and it imports
``os`` and holds capabilities in every way a module might, by accident or on purpose: in
globals, in class attributes, in instance attributes, in dicts, behind wrappers, and as
values its functions return. None of them may reach a caller. It also has what ordinary
use needs (a torch module, a dataclass, cached and partial functions), which must keep
working.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import contextvars
import functools
import importlib
import io
import logging
import operator
import os
import pickle
import string
import subprocess
import sys
import textwrap
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_bridge.bridge import diag

# -- capabilities held in globals ------------------------------------------------------

BUILTINS = vars(builtins)  # the builtins namespace itself
BUILTINS_COPY = dict(vars(builtins))  # an ordinary dict that holds eval, open, ...
RUN = subprocess.run
SYSTEM = os.system
OPEN = open
EVAL = eval
IMPORT = importlib.import_module
LOADS = pickle.loads
LOGGER = logging.getLogger("security_probe")
WRITE = sys.stderr.write
PARTIAL_SYSTEM = functools.partial(os.system, "true")
ATTRGETTER = operator.attrgetter("real")
METHODCALLER = operator.methodcaller("system", "true")
STATIC_SYSTEM = staticmethod(os.system)
FORMAT = "{0.__class__}".format
FORMATTER = string.Formatter()
WEAK = weakref.ref(LOGGER)
STACK = contextlib.ExitStack()
MODULES = {"os": os, "sys": sys}  # modules inside a dict
SYS_MODULES = sys.modules
SYS_PATH = sys.path
OS_NAMESPACE = vars(os)
DIAG_NAMESPACE = vars(diag)  # an allow-listed module's namespace
ROOT_HANDLERS = logging.getLogger().handlers  # where the worker's log handler hangs
NAMES = ["eval", "exec", "open", "__import__", "getattr", "vars", "globals", "compile"]
TORCH_LOAD = torch.load
NP_LOAD = np.load

# -- ordinary values the value guard lets through, which must not be *called* -------------

DEDENT = textwrap.dedent  # a plain function of a module outside the allow-list
RELU = torch.relu  # torch's, and torch is not allow-listed here
ORDERED = collections.OrderedDict  # a foreign class
UFUNC = np.add  # a foreign callable instance (its __call__ is numpy's)

# -- ordinary things that must keep working -------------------------------------------

LOG_LINES: list[str] = []  # a list attribute: its append is an ordinary method


@dataclass
class Point:
    """A registered dataclass (defined here, an allow-listed module): travels by value."""

    x: int
    y: int = 0


def add(a: int, b: int) -> int:
    """``a + b``."""
    return a + b


PARTIAL_ADD = functools.partial(add, 1)


@functools.lru_cache(maxsize=None)
def square(x: int) -> int:
    """``x * x``, cached."""
    return x * x


def make_model() -> torch.nn.Module:
    """A small torch module that travels as a reference."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())


def sparse() -> torch.Tensor:
    """A sparse tensor: not strided, so it travels as a reference."""
    return torch.eye(3).to_sparse()


def object_array() -> np.ndarray:
    """An array of dtype object: it travels as a reference."""
    return np.array([1, "a"], dtype=object)


def numpy_values() -> list[Any]:
    """A numpy float, a numpy int and an int array (all by value)."""
    return [np.float64(1.5), np.int64(3), np.arange(3)]


def imported(name: str) -> bool:
    """Whether module ``name`` is imported in this process."""
    return name in sys.modules


# -- capabilities in class and instance attributes ---------------------------------------


class Holder:
    """Holds capabilities as class and instance attributes, beside ordinary ones."""

    os = os  # a module as a class attribute
    runner = subprocess.run
    shell = staticmethod(os.system)
    log = logging.getLogger("security_probe.holder")
    value = 3

    def __init__(self) -> None:
        self.module = sys
        self.frame = sys._getframe()
        self.array = np.zeros(3)
        self.buffer = io.BytesIO(b"x")
        self.context = contextvars.copy_context()
        self._private = "mine"

    def method(self) -> int:
        """An ordinary method."""
        return self.value

    def _helper(self) -> str:
        """A private method of this (allow-listed) module's class."""
        return self._private

    @classmethod
    def make(cls) -> Holder:
        """An ordinary class method."""
        return cls()


def holder() -> Holder:
    """A :class:`Holder`, by reference."""
    return Holder()


# -- functions that hand capabilities back as values ----------------------------------


def gen() -> Iterator[int]:
    """A generator: usable as such, its frame and code are not."""
    yield 1
    yield 2


async def coro() -> int:
    """A coroutine function."""
    return 1


async def agen() -> Any:
    """An async generator function."""
    yield 1


#: Coroutines handed out, kept so that none is collected unawaited during a test.
_KEPT: list[Any] = []


def make_coroutine() -> Any:
    """A coroutine object (never awaited: only its attributes matter here)."""
    c = coro()
    _KEPT.append(c)
    return c


def make_async_generator() -> Any:
    """An async generator object."""
    return agen()


def caught() -> BaseException:
    """An exception that was raised and caught (it carries a traceback)."""
    try:
        raise ValueError("caught")
    except ValueError as exc:
        return exc


def traceback_of() -> Any:
    """A traceback object."""
    try:
        raise ValueError("tb")
    except ValueError:
        return sys.exc_info()[2]


def exc_info() -> Any:
    """``sys.exc_info()`` inside an ``except``: type, exception, traceback."""
    try:
        raise ValueError("info")
    except ValueError:
        return sys.exc_info()


def frames() -> Iterator[Any]:
    """A generator whose chunks are frames."""
    yield sys._getframe()


def opened() -> Any:
    """An open file (a context manager, and iterable)."""
    return open(os.devnull)


def frame() -> Any:
    """The calling frame."""
    return sys._getframe()


def code() -> Any:
    """A code object."""
    return gen.__code__


def cell() -> Any:
    """A closure cell."""
    x = 1

    def inner() -> int:
        return x

    return inner.__closure__[0]  # type: ignore[index]


def module(name: str) -> types.ModuleType:
    """The imported module ``name``."""
    return sys.modules[name]


def nested() -> dict[str, Any]:
    """An ordinary dict with eval nested inside."""
    return {"ok": 1, "items": [1, 2, (3, eval)]}


def point_with_eval() -> Point:
    """A :class:`Point` whose ``y`` is eval."""
    return Point(1, eval)  # type: ignore[arg-type]


def mixed() -> list[Any]:
    """An object that travels as a reference, then eval: the reply fails on the second."""
    return [Holder(), eval]


def builtins_dict() -> dict[str, Any]:
    """The builtins namespace, returned by value."""
    return vars(builtins)


def identity(value: Any) -> Any:
    """``value`` back (an argument passed through)."""
    return value


def call_it(fn: Any, *args: Any) -> Any:
    """``fn(*args)``: calls whatever it is given."""
    return fn(*args)


def type_of(value: Any) -> type:
    """``type(value)``."""
    return type(value)


def bound_logger_method() -> Any:
    """A logger's bound method that would rewire logging."""
    return LOGGER.addHandler


def storage() -> Any:
    """A tensor's untyped storage."""
    return torch.zeros(2).untyped_storage()


def enum_convert() -> Any:
    """``Level._convert_`` (bound to an allow-listed enum): it rewrites any module's
    namespace by name."""
    return diag.Level._convert_


def enum_create() -> Any:
    """``Level._create_``: makes a new enum class."""
    return diag.Level._create_


def compile_of(model: torch.nn.Module) -> Any:
    """``model.compile``: torch.compile with the caller's options."""
    return model.compile


def count_modules(module: torch.nn.Module) -> None:
    """Records that ``module`` was visited (an ordinary callable for ``Module.apply``)."""
    LOG_LINES.append(type(module).__name__)


def getter(name: str) -> Any:
    """``operator.attrgetter(name)``."""
    return operator.attrgetter(name)


def unset_marker(path: str) -> bool:
    """Whether ``path`` does not exist (what an escape would have created)."""
    return not os.path.exists(path)
