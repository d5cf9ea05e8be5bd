"""Code for the tests that every request is answered (python/tests/bridge/test_worker_answers.py),
run by a worker that allow-lists this module (this directory on its ``PYTHONPATH``):
exceptions whose ``__str__`` raises, and a fault injected into the worker itself."""

from __future__ import annotations

from typing import Any


class StrFails(Exception):
    """An exception whose ``__str__`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no str")


class WorseStrFails(Exception):
    """An exception whose ``__str__`` raises an exception whose ``__str__`` raises."""

    def __str__(self) -> str:
        raise StrFails()


class BaseStrFails(BaseException):
    """A ``BaseException`` (not an ``Exception``) whose ``__str__`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no str either")


def raise_it(kind: str) -> None:
    """Raise one of the classes above, by name."""
    raise {"StrFails": StrFails, "WorseStrFails": WorseStrFails, "BaseStrFails": BaseStrFails}[kind]()


_saved: dict[str, Any] = {}


def break_error_replies() -> None:
    """Inject a fault into the worker: from now on the dispatcher cannot build an error
    reply (its ``error_map`` raises), so a failing request's handler raises in turn."""
    from vllm_bridge.bridge.worker import dispatch

    def broken(exc: BaseException, exc_id: int | None = None) -> dict[str, Any]:
        raise RuntimeError("injected: error replies cannot be built")

    _saved.setdefault("error_map", dispatch.error_map)
    dispatch.error_map = broken


def mend_error_replies() -> None:
    """Undo :func:`break_error_replies`."""
    from vllm_bridge.bridge.worker import dispatch

    dispatch.error_map = _saved.pop("error_map")


def tensor_and_bytes(elems: int, nbytes: int) -> list[Any]:
    """``[a float32 tensor of `elems` zeros, `nbytes` bytes]``: a reply whose tensor may go
    into a result slot while the rest of its frame is over a small frame limit
    (python/tests/bridge/test_protocol_slots_refused.py)."""
    import torch

    return [torch.zeros(elems, dtype=torch.float32), b"x" * nbytes]
