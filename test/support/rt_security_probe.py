"""A user module for the Elixir security tests (test/runtime/security_test.exs): it
imports ``os`` and hands capabilities back, beside what ordinary use needs (a torch module
that travels as a reference)."""

from __future__ import annotations

import builtins
import importlib
import os
import sys
from typing import Any

import torch

SYSTEM = os.system
BUILTINS_COPY = dict(vars(builtins))  # an ordinary dict that holds eval


def module(name: str) -> Any:
    """The imported module ``name`` (a module outside the allow-list for ``"os"``)."""
    return sys.modules[name]


def identity(value: Any) -> Any:
    """``value`` back: an argument passed through."""
    return value


def itself() -> Any:
    """This module (allow-listed), as a value."""
    return sys.modules[__name__]


def reimport() -> bool:
    """Import this module afresh: from then on, a reference to the old module object
    stands for a module that is no longer the allow-listed one."""
    del sys.modules[__name__]
    importlib.import_module(__name__)
    return True


def make_model() -> torch.nn.Module:
    """A small torch module: it travels as a reference."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 2))


def opened() -> Any:
    """An open file: a context manager, and iterable."""
    return open(os.devnull)
