"""The step rule: which attribute names a path may take from an object
(docs/SECURITY.md, "What a path may name"), judged before the attribute is read.

Beside the value guard's check of what each step reaches (:mod:`~vllm_bridge.bridge.worker.guard`),
two kinds of name are refused by where they are defined:

* **a private name** (one ``_``, not a dunder: dunders are refused by the resolver) that
  no allow-listed module defines: ``Level._convert_`` (enum's), a torch module's
  ``_forward_hooks`` or ``_modules``, a tensor's ``_base``. Such names are the internals
  of code outside the allow-list, which no caller needs and the guard cannot vet one by
  one (an enum's ``_member_map_`` is a plain dict whose ``clear`` would break every
  lookup of that enum). A module's own private globals (``vllm_bridge.bridge.diag._journal``),
  and the private attributes of classes defined in allow-listed modules and of their
  instances, stay reachable. The definer is found the way ``getattr`` finds the name: an
  instance's own ``__dict__`` (counted as its class's), its class's MRO, and for a class
  its metaclass's MRO; an enum's ``_sunder_`` names are always enum's.
* **an attribute of a handed-out object** (:data:`~guard_tables.OPEN_CLASSES`, a
  logger) other than its listed methods and :data:`~guard_tables.OPEN_ATTRIBUTES`: a
  logger's ``filters``, ``handlers``, ``_cache``, ``parent``, ``manager`` hold what the
  worker's own logging runs on.
"""

from __future__ import annotations

import enum
import sys
import types
from typing import Any

from vllm_bridge.bridge.protocol.errors import BadArgument
from vllm_bridge.bridge.worker import guard_tables as tables
from vllm_bridge.bridge.worker.guard_messages import qualified

_CACHE_LIMIT = 4096


class StepRule:
    """Decides which attribute names a path may take, for one allow-list."""

    def __init__(self, allowed: frozenset[str]) -> None:
        self.allowed = allowed
        #: class -> the names a path may take from its instances (an OPEN_CLASSES
        #: instance), or None (any name the other rules let through). The resolver
        #: reads it to skip :meth:`check` for a public name on an ordinary object.
        self.open: dict[type, frozenset[str] | None] = {}
        self._open_classes: tuple[tuple[type, tuple[str, ...]], ...] = ()
        self._modules_seen = -1

    def check(self, obj: Any, name: str, where: str) -> None:
        """Nothing when a path may take ``name`` from ``obj`` (``where`` names ``obj``).

        Raises:
            BadArgument: naming the attribute, ``where``, and why.
        """
        if type(obj) is types.ModuleType:  # an allow-listed module: any name of its own
            return
        names = self.open.get(type(obj), tables.MISSING)
        if names is tables.MISSING:
            names = self._open_names(type(obj))
        if names is not None and name not in names:
            raise BadArgument(
                f"attribute {name!r} of {where} is {tables.CLOSED}: a "
                f"{qualified(type(obj))} offers only {', '.join(sorted(names))} "
                "(see docs/SECURITY.md)"
            )
        if name[:1] == "_" and not isinstance(obj, types.ModuleType):
            home = self._private_home(obj, name)
            if home is not None:
                raise BadArgument(
                    f"attribute {name!r} of {where} is {tables.PRIVATE} (it is {home}'s): a "
                    "name with a leading '_' is reachable only where an allow-listed module "
                    "defines it (see docs/SECURITY.md)"
                )

    def _private_home(self, obj: Any, name: str) -> str | None:
        """Who defines the private ``name`` of ``obj`` (``module.Class``) when that is
        outside the allow-list, else ``None``."""
        if _sunder(name) and isinstance(obj, (enum.Enum, enum.EnumMeta)):
            return "enum" if "enum" not in self.allowed else None
        definer = _definer(obj, name)
        home = getattr(definer, "__module__", None)
        if isinstance(home, str) and home in self.allowed:
            return None
        return qualified(definer)

    def _open_names(self, cls: type) -> frozenset[str] | None:
        self._refresh()
        names: set[str] | None = None
        for open_cls, methods in self._open_classes:
            if issubclass(cls, open_cls):
                names = (names or set()) | set(methods) | set(tables.OPEN_ATTRIBUTES)
        verdict = None if names is None else frozenset(names)
        if len(self.open) >= _CACHE_LIMIT:
            self.open.clear()
        self.open[cls] = verdict
        return verdict

    def _refresh(self) -> None:
        if len(sys.modules) == self._modules_seen:
            return
        found = tuple(
            (cls, methods)
            for cls, methods in (
                (tables.lookup(module, attr), methods)
                for module, attr, methods in tables.OPEN_CLASSES
            )
            if isinstance(cls, type)
        )
        if [c for c, _ in found] != [c for c, _ in self._open_classes]:
            self._open_classes = found
            self.open.clear()
        self._modules_seen = len(sys.modules)


def _sunder(name: str) -> bool:
    """``_name_``: the names enum reserves for itself."""
    return len(name) > 2 and name[0] == name[-1] == "_" and name[1] != "_" and name[-2] != "_"


def _definer(obj: Any, name: str) -> Any:
    """The class where ``getattr(obj, name)`` finds ``name`` (an instance attribute counts
    as its class's; a name no class defines, served by ``__getattr__``, too)."""
    if isinstance(obj, type):
        for cls in (*obj.__mro__, *type(obj).__mro__):
            if name in vars(cls):
                return cls
        return type(obj)
    cls = type(obj)
    try:
        own = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        own = None
    if isinstance(own, dict) and name in own:
        return cls
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    return cls
