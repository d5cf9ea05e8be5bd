"""The call rule: what a caller may *call* (docs/SECURITY.md, "What may be called").

The value guard (:mod:`~vllm_bridge.bridge.worker.guard`) keeps capabilities from being reached,
held or handed out; it judges an object by where it is at home, against a list of refused
homes. That cannot see a method of an ordinary object that wraps a capability: a torch
module's ``compile`` runs ``torch.compile``, whose inductor backend runs a compiler the
caller's options name; an enum class's ``_convert_`` rewrites any module's namespace by
name. So the object about to be called (the target of ``call``/``stream``/``enter``, a
reference called with no path included) meets a positive rule, :meth:`CallRule.check`,
and so does every callable reference passed as an argument (the code it is passed to may
call it). It may be called only if it is

* **code defined in an allow-listed module**: a function or class whose ``__module__`` is
  exactly allow-listed; a method whose function is (bound, or a class method); an
  instance of such a class whose ``__call__`` is defined there too; ``staticmethod``,
  ``functools.partial`` and ``functools.lru_cache`` objects are judged by what they call,
  a type alias (``list[UBatchSlice]``) by its class;
* or **a listed method of a value type** (:data:`~guard_tables.CALLABLE_METHODS`:
  tensors, torch modules, arrays, builtin containers and scalars, generators; a logger's
  logging methods, :data:`~guard_tables.OPEN_CLASSES`), a builtin container's or scalar's
  class (:data:`~guard_tables.CALLABLE_CLASSES`), or a torch module itself
  (:data:`~guard_tables.CALLABLE_INSTANCES`).

An enum class may be called with one value (a member lookup), never with more arguments
or with keywords: that is enum's functional API, which makes a new class.

Everything else is refused with ``bad_argument`` naming the callable, where it is defined
and the rule. Verdicts are cached per long-lived callable and per owner class and method,
so calling a known function costs one dict lookup (:attr:`CallRule.passed`).
"""

from __future__ import annotations

import enum
import functools
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_bridge.bridge.protocol.errors import BadArgument
from vllm_bridge.bridge.worker import guard_tables as tables
from vllm_bridge.bridge.worker.guard_messages import describe, qualified

#: Bound on each verdict cache (classes made per call must not grow them forever).
_CACHE_LIMIT = 4096
#: functools.lru_cache's wrapper: judged by the function it wraps.
_LRU_WRAPPER = type(functools.lru_cache(maxsize=None)(len))
_NO_ARGS: tuple[Any, ...] = ()


class CallRule:
    """Decides what a caller may call, for one allow-list."""

    def __init__(self, allowed: frozenset[str]) -> None:
        self.allowed = allowed
        #: id -> callable, for long-lived callables that may be called whatever the
        #: arguments (an enum class is never here): :meth:`check` reads it first.
        self.passed: dict[int, Any] = {}
        #: id -> (callable, verdict) for long-lived functions, classes and C functions.
        self._objects: dict[int, tuple[Any, str | None]] = {}
        #: (owner class, function id or C method name) -> (function or name, verdict).
        self._bound: dict[tuple[type, Any], tuple[Any, str | None]] = {}
        #: class -> verdict on calling its instances.
        self._instances: dict[type, str | None] = {}
        #: method name -> the classes it is listed for (CALLABLE_METHODS, OPEN_CLASSES).
        self._methods: dict[str, tuple[type, ...]] = {}
        self._classes: dict[int, type] = {}
        #: The listed classes themselves: the C methods of their instances are found in
        #: ``_bound`` by :meth:`check` without a further call.
        self._value_types: frozenset[type] = frozenset()
        self._callable_instances: tuple[type, ...] = ()
        self._resolved: tuple[int, ...] | None = None
        self._modules_seen = -1
        self._refresh()

    def check(
        self,
        fn: Any,
        where: str,
        args: Sequence[Any] = _NO_ARGS,
        kwargs: Mapping[str, Any] | None = None,
        note: str = "",
    ) -> None:
        """Nothing when ``fn(*args, **kwargs)`` may be run for a caller.

        Raises:
            BadArgument: naming ``where`` (the target, the argument), what ``fn`` is,
                where it is defined and the rule (``note`` is added to the message).
        """
        if self.passed.get(id(fn)) is fn:
            return
        t = type(fn)
        if t is types.MethodType:  # a method of a reference: its cached verdict
            owner, func = fn.__self__, fn.__func__
            entry = self._bound.get((owner if isinstance(owner, type) else type(owner), id(func)))
            home = entry[1] if entry is not None and entry[0] is func else self.reason(fn)
        elif t is types.BuiltinFunctionType and type(fn.__self__) in self._value_types:
            # a C method of a plain value (str.upper, list.append): cached by name
            entry = self._bound.get((type(fn.__self__), fn.__name__))
            home = entry[1] if entry is not None else self.reason(fn)
        else:
            home = self.reason(fn)
            if home is None:
                self._check_enum(fn, where, len(args), kwargs or {})
        if home is not None:
            raise self.refusal(fn, where, home, note)

    def _check_enum(self, fn: Any, where: str, nargs: int, kwargs: Mapping[str, Any]) -> None:
        """An enum class (also behind a partial or a staticmethod, with the arguments
        the partial adds) may be called with one value only."""
        for _ in range(8):  # wrappers of wrappers: a few at most
            if isinstance(fn, functools.partial):
                nargs += len(fn.args)
                kwargs = {**fn.keywords, **kwargs}
                fn = fn.func
            elif isinstance(fn, staticmethod):
                fn = fn.__func__
            else:
                break
        if isinstance(fn, enum.EnumMeta) and (nargs > 1 or kwargs):
            raise self._functional_enum(fn, where, nargs, kwargs)

    def _functional_enum(
        self, fn: Any, where: str, nargs: int, kwargs: Mapping[str, Any]
    ) -> BadArgument:
        keywords = f" and the keywords {', '.join(sorted(map(str, kwargs)))}" if kwargs else ""
        return BadArgument(
            f"{where} is the enum class {qualified(fn)}, called with {nargs} "
            f"positional arguments{keywords}: that is enum's functional API, which "
            "makes a new class, and no caller may call it; call an enum with one value "
            "to look a member up (see docs/SECURITY.md)"
        )

    def refusal(self, fn: Any, where: str, home: str, note: str = "") -> BadArgument:
        """The error for calling ``fn`` (defined in ``home``), found at ``where``."""
        return BadArgument(
            f"{where} is {describe(fn)}, defined in {home}, which no caller may call{note}: "
            f"{tables.CALL_RULE} (see docs/SECURITY.md)"
        )

    def reason(self, fn: Any) -> str | None:
        """Where ``fn`` is defined (for the message) when it may not be called, else
        ``None``. The arguments are not looked at (see :meth:`check` for enums)."""
        t = type(fn)
        # Bound methods first: new objects at each access, cached per owner class.
        if t is types.MethodType:
            return self._bound_reason(fn.__self__, fn.__func__)
        if t is types.BuiltinFunctionType:
            owner = fn.__self__
            if owner is not None and not isinstance(owner, types.ModuleType):
                return self._bound_reason(owner, fn.__name__)  # tensor.sum, dict.fromkeys
        entry = self._objects.get(id(fn))
        if entry is not None and entry[0] is fn:
            return entry[1]
        self._refresh()
        lasting = False
        if t is types.FunctionType:
            reason = self._home_reason(fn.__module__)
            lasting = "<locals>" not in fn.__qualname__
        elif isinstance(fn, type):
            if self._classes.get(id(fn)) is fn:
                reason = None
            else:
                reason = self._home_reason(getattr(fn, "__module__", None))
            lasting = "<locals>" not in getattr(fn, "__qualname__", "<locals>")
        elif t is types.BuiltinFunctionType:  # a C function of a module (posix.system)
            owner = fn.__self__
            reason = self._home_reason(owner.__name__ if owner is not None else fn.__module__)
            lasting = True
        elif t in tables.METHOD_KINDS:  # unbound C methods (str.upper) and slot wrappers
            cls = getattr(fn, "__objclass__", None)
            if cls is None:
                cls = type(getattr(fn, "__self__", None))
            name = fn.__name__
            listed = self._listed(cls, name) or any(  # torch.Tensor.sum is TensorBase's
                getattr(base, name, None) is fn for base in self._methods.get(name, ())
            )
            reason = None if listed else _defined_in(cls)
            lasting = t is not types.MethodWrapperType
        elif isinstance(fn, staticmethod):
            reason = self.reason(fn.__func__)
        elif isinstance(fn, _LRU_WRAPPER):
            reason = self.reason(getattr(fn, "__wrapped__", None))
        elif isinstance(fn, functools.partial):
            reason = self.reason(fn.func)
        elif t is types.GenericAlias:  # list[UBatchSlice]: calling it calls list
            reason = self.reason(fn.__origin__)
        else:  # an instance: what runs is its class's __call__
            reason = self._instance_reason(t)
        if lasting:
            if len(self._objects) >= _CACHE_LIMIT:
                self._objects.clear()
                self.passed.clear()
            self._objects[id(fn)] = (fn, reason)
            if reason is None and not isinstance(fn, enum.EnumMeta):
                self.passed[id(fn)] = fn
        return reason

    # -- verdicts ------------------------------------------------------------------------

    def _home_reason(self, home: Any) -> str | None:
        if isinstance(home, str):
            return None if home in self.allowed else home
        return "no module (it names none)"

    def _listed(self, cls: Any, name: Any) -> bool:
        """Whether ``name`` is a listed method of ``cls`` or of a base of it."""
        bases = self._methods.get(name) if isinstance(name, str) else None
        if not bases or not isinstance(cls, type):
            return False
        return issubclass(cls, bases)

    def _bound_reason(self, owner: Any, fn: Any) -> str | None:
        """A method bound to ``owner`` (an instance, or a class for a class method):
        ``fn`` is its function, or a C method's name."""
        cls = owner if isinstance(owner, type) else type(owner)
        named = type(fn) is str
        key = (cls, fn if named else id(fn))
        entry = self._bound.get(key)
        if entry is not None and (named or entry[0] is fn):
            return entry[1]
        self._refresh()
        if named:  # a C method is defined with its class
            reason = None if self._listed(cls, fn) else _defined_in(cls)
        else:
            home = getattr(fn, "__module__", None)
            if isinstance(home, str) and home in self.allowed:
                reason = None
            elif self._listed(cls, getattr(fn, "__name__", None)):
                reason = None
            else:
                reason = self._home_reason(home)
        if named or "<locals>" not in getattr(fn, "__qualname__", "<locals>"):
            if len(self._bound) >= _CACHE_LIMIT:
                self._bound.clear()
            self._bound[key] = (fn, reason)
        return reason

    def _instance_reason(self, cls: type) -> str | None:
        """Calling an instance of ``cls`` runs its class's ``__call__``."""
        try:
            return self._instances[cls]
        except KeyError:
            pass
        definer, call = _find(cls, "__call__")
        reason: str | None
        if definer is None:
            reason = _defined_in(cls)  # not callable: the dispatcher said so already
        else:
            home = getattr(call, "__module__", None)
            if not isinstance(home, str):
                home = getattr(definer, "__module__", None)
            if isinstance(home, str) and home in self.allowed:
                # An allow-listed __call__, on an instance of an allow-listed class.
                reason = self._home_reason(getattr(cls, "__module__", None))
            elif any(
                issubclass(cls, base) and call is vars(base).get("__call__")
                for base in self._callable_instances
            ):
                reason = None  # a torch module, whose __call__ is torch's own
            else:
                reason = self._home_reason(home)
        if len(self._instances) >= _CACHE_LIMIT:
            self._instances.clear()
        self._instances[cls] = reason
        return reason

    # -- the tables, looked up in sys.modules as modules are imported --------------------

    def _refresh(self) -> None:
        """Resolve the tables' classes whose modules are imported by now (cheap when
        nothing was imported since the last look); the caches go when that changes what
        is listed."""
        if len(sys.modules) == self._modules_seen:
            return
        listed = [
            (tables.lookup(module, attr), names, exceptions)
            for module, attr, names, exceptions in tables.CALLABLE_METHODS
        ]
        listed += [
            (tables.lookup(module, attr), names, ())
            for module, attr, names in tables.OPEN_CLASSES
        ]
        listed = [(cls, names, exc) for cls, names, exc in listed if isinstance(cls, type)]
        classes = [tables.lookup(m, a) for m, a in tables.CALLABLE_CLASSES]
        instances = [tables.lookup(m, a) for m, a in tables.CALLABLE_INSTANCES]
        classes = [c for c in classes if isinstance(c, type)]
        instances = [c for c in instances if isinstance(c, type)]
        resolved = tuple(id(c) for c in [*(c for c, _, _ in listed), *classes, *instances])
        if resolved != self._resolved:
            methods: dict[str, list[type]] = {}
            for cls, names, exceptions in listed:
                for name in _names(cls, names, exceptions):
                    methods.setdefault(name, []).append(cls)
            self._methods = {name: tuple(bases) for name, bases in methods.items()}
            self._classes = {id(c): c for c in classes}
            self._value_types = frozenset(c for c, _, _ in listed)
            self._callable_instances = tuple(instances)
            self._resolved = resolved
            self.passed.clear()
            self._objects.clear()
            self._bound.clear()
            self._instances.clear()
        self._modules_seen = len(sys.modules)


def _names(cls: type, names: tuple[str, ...], exceptions: tuple[str, ...]) -> list[str]:
    if names is tables.PUBLIC:
        names = tuple(
            n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n, None))
        )
    return [n for n in names if n not in exceptions]


def _find(cls: type, name: str) -> tuple[type | None, Any]:
    """The class of ``cls``'s MRO that defines ``name``, and what it defines."""
    for klass in getattr(cls, "__mro__", ()):
        found = vars(klass).get(name, tables.MISSING)
        if found is not tables.MISSING:
            return klass, found
    return None, None


def _defined_in(cls: Any) -> str:
    home = getattr(cls, "__module__", None)
    return home if isinstance(home, str) else "no module (it names none)"
