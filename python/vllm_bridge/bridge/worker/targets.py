"""Call targets: what ``["m", module, path]`` and ``["r", ref, path]`` may reach.

Rules (docs/PROTOCOL.md, "Targets"):

* a module target names a module of the allow-list exactly; only allow-listed modules are
  ever imported because of a request;
* no path part may be empty or start with ``__`` (dunders are unreachable by name);
* every step of a path, and the object a reference stands for, must pass the value
  guard (:mod:`~vllm_bridge.bridge.worker.guard`): no step may land on a module outside the
  allow-list (``vllm_bridge.bridge.diag.os`` is refused although ``diag`` imports ``os``), a
  frame, a code object, an evaluating builtin, the worker's own machinery...
  (docs/SECURITY.md);
* before it is read, each name of a path must pass the step rule
  (:mod:`~vllm_bridge.bridge.worker.guard_steps`): no private name that only code outside the
  allow-list defines (``Level._convert_``), nothing of a logger but its listed methods
  and plain attributes. (A name taken from an allow-listed module needs no such look:
  the one-step fast path below.)

Refusals raise :class:`~vllm_bridge.bridge.protocol.errors.BadArgument` naming the step.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterable
from typing import Any

from vllm_bridge.bridge.protocol.errors import BadArgument, safe_str, short_repr
from vllm_bridge.bridge.protocol.messages import ModuleTarget, RefTarget, Target
from vllm_bridge.bridge.worker.guard import Guard
from vllm_bridge.bridge.worker.guard_tables import MISSING
from vllm_bridge.bridge.worker.sessions import Session, Sessions


class TargetResolver:
    """Resolves targets against an allow-list of module names."""

    def __init__(self, modules: Iterable[str]) -> None:
        self.modules: tuple[str, ...] = tuple(modules)
        self._allowed = frozenset(self.modules)
        #: Checks every value a target reaches; the dispatcher checks replies and
        #: argument references with it too.
        self.guard = Guard(self._allowed)

    def module(self, name: str) -> types.ModuleType:
        """The allow-listed module ``name``, imported on first use.

        Raises:
            BadArgument: ``name`` is not allow-listed, or it fails to import.
        """
        if name not in self._allowed:
            raise BadArgument(
                f"module {short_repr(name)} is not in the worker's allow-list "
                f"({', '.join(self.modules)})"
            )
        module = sys.modules.get(name)
        if module is not None:
            return module
        try:
            return importlib.import_module(name)
        except Exception as exc:
            raise BadArgument(
                f"allow-listed module {name!r} failed to import: {type(exc).__name__}: "
                f"{safe_str(exc):.1000}"
            ) from None

    def resolve(self, target: Target, sessions: Sessions, session: Session) -> tuple[Any, str]:
        """The object a target names, and a description of it for messages."""
        if isinstance(target, ModuleTarget):
            # module()'s common case inline (allow-listed and imported already).
            obj = sys.modules.get(target.module) if target.module in self._allowed else None
            if obj is None:
                obj = self.module(target.module)
            path = target.path
            if path and "." not in path and not path.startswith("__"):
                # One step (the common case): the checks of walk() without its strings.
                try:
                    obj = getattr(obj, path)
                except AttributeError:
                    raise BadArgument(
                        f"{target.module} has no attribute {short_repr(path)}"
                    ) from None
                where = f"{target.module}.{path}"
                if self.guard.passed.get(id(obj)) is not obj:  # a known function: passes
                    self.guard.check(obj, where)
                return obj, where
            return self.walk(obj, path, target.module), f"{target.module}.{path}"
        if isinstance(target, RefTarget):
            obj = sessions.resolve(session, target.ref)
            where = f"reference {target.ref.ref_id} ({target.ref.type_name})"
            # Vetted when the reference was made; vetted again as it is used.
            self.guard.check(obj, where)
            if target.path is None:
                return obj, where
            return self.walk(obj, target.path, where), f"{where}.{target.path}"
        raise BadArgument(f"not a target: {target!r:.100}")

    def walk(self, obj: Any, path: str, where: str) -> Any:
        """Follow the dotted ``path`` from ``obj`` (``where`` names ``obj`` in messages)."""
        if not path:
            raise BadArgument(f"empty attribute path after {where}")
        steps = self.guard.steps
        open_names = steps.open
        for part in path.split("."):
            if not part:
                raise BadArgument(
                    f"attribute path {short_repr(path)} after {where} has an empty part"
                )
            if part.startswith("__"):
                raise BadArgument(
                    f"attribute {short_repr(part)} of {where} is unreachable: no path part "
                    "may start with '__'"
                )
            # The step rule; for a public name on an ordinary object (or a module),
            # the look that it has nothing to say is inlined.
            t = type(obj)
            if t is not types.ModuleType and (
                part[0] == "_" or open_names.get(t, MISSING) is not None
            ):
                steps.check(obj, part, where)
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise BadArgument(f"{where} has no attribute {short_repr(part)}") from None
            where = f"{where}.{part}"
            # Each step before the next: getattr never runs on a refused object.
            self.guard.check(obj, where)
        return obj
