"""The allow-list of the worker this process runs, for code that runs inside it.

The worker publishes its allow-list once, at start (:func:`publish`, from
:func:`vllm_bridge.bridge.worker.server.main`), before it reads any request; code a
request calls can only read it (:func:`current`). The introspection module describes only
modules of this list, so a worker that allow-lists it does not become a way to import
any module by name.

This module is never allow-listed itself and none of its names is reachable from an
allow-listed module's namespace but :func:`current`: a request can neither publish nor
replace the list (and a second :func:`publish` is refused anyway).
"""

from __future__ import annotations

from collections.abc import Iterable

_published: tuple[str, ...] | None = None


def publish(modules: Iterable[str]) -> None:
    """Record the allow-list of the worker of this process (once).

    Raises:
        RuntimeError: an allow-list was published already.
        TypeError: ``modules`` holds something other than module names (str).
    """
    global _published
    if _published is not None:
        raise RuntimeError("the worker's allow-list is published already and cannot change")
    names = tuple(modules)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"an allow-listed module must be a name (str), got {name!r}")
    _published = names


def current() -> tuple[str, ...] | None:
    """The published allow-list, or ``None`` when this process is not a worker."""
    return _published
