"""The value guard: the allow-list enforced on values, not only on names (docs/SECURITY.md).

A name check alone does not keep a caller inside the allow-list: an object reached
through an ordinary attribute (a generator's ``gi_frame``, a dict holding builtins, a
module a user module imported) hands out whatever it holds. So every value that crosses
the worker's boundary meets :meth:`Guard.check`:

* each step of an attribute path, the callable about to be called included
  (:class:`~vllm_bridge.bridge.worker.targets.TargetResolver`);
* every object about to become a reference: results, stream chunks, entered values, and
  values nested in them (``make_ref`` in :class:`~vllm_bridge.bridge.worker.dispatch.Dispatcher`);
  plain data that travels by value has no behaviour and is not looked at;
* every reference resolved as a target or an argument, again (what was vetted when the
  reference was made is vetted when it is used).

What it refuses is a denylist of *capabilities* (:mod:`~vllm_bridge.bridge.worker.guard_tables`),
decided by type, by identity and by *home* module (a function's ``__module__``, a C
function's module, a class's ``__module__``; a bound method is judged by its owner and its
function), never by the value's contents. Verdicts per type are cached, so an ordinary
value costs one dict lookup; callables and classes are judged one by one (cheaply).
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

from vllm_bridge.bridge.protocol.errors import BadArgument
from vllm_bridge.bridge.worker import guard_tables as tables
from vllm_bridge.bridge.worker.guard_calls import CallRule
from vllm_bridge.bridge.worker.guard_messages import describe
from vllm_bridge.bridge.worker.guard_steps import StepRule

#: A type verdict meaning "judge each object of this type on its own".
_EACH = object()
_MISSING = tables.MISSING
#: Bound on the verdict caches (dynamic classes made per call must not grow them forever).
_CACHE_LIMIT = 4096

#: functools.lru_cache's wrapper: judged by the function it wraps.
_LRU_WRAPPER = type(functools.lru_cache(maxsize=None)(len))
#: Types judged object by object: what can be called, and wrappers judged by what they
#: wrap (a subclass of the last four too, see :meth:`Guard._type_verdict`).
_EACH_TYPES = frozenset(
    {types.FunctionType, types.BuiltinFunctionType, types.MethodType, *tables.METHOD_KINDS}
)
_EACH_BASES = (types.ModuleType, type, staticmethod, functools.partial, _LRU_WRAPPER)
#: Containers judged one by one too: a module's namespace and the interpreter's
#: registries are plain dicts and lists (guard_tables.CONTAINERS).
_CONTAINER_TYPES = (dict, list)


class Guard:
    """Decides which objects a caller may reach, hold or hand back, for one allow-list;
    :attr:`steps` which names a path may take and :attr:`calls` what may be called."""

    def __init__(self, allowed: frozenset[str]) -> None:
        self.allowed = allowed
        #: The step rule (:mod:`~vllm_bridge.bridge.worker.guard_steps`): private names defined
        #: outside the allow-list, a handed-out logger's other attributes.
        self.steps = StepRule(allowed)
        #: The call rule (:mod:`~vllm_bridge.bridge.worker.guard_calls`): only code defined in an
        #: allow-listed module, or a listed method of a value type, may be called.
        self.calls = CallRule(allowed)
        #: type -> None (its instances pass), a reason (refused), or _EACH.
        self._types: dict[type, Any] = {}
        #: id -> (object, reason) for long-lived objects judged one by one: module-level
        #: functions and classes, C functions (closures are not kept alive here).
        self._objects: dict[int, tuple[Any, str | None]] = {}
        #: id -> object, for those of ``_objects`` that pass: the resolver's one-step fast
        #: path reads it (``passed.get(id(obj)) is obj``) before calling :meth:`check`.
        self.passed: dict[int, Any] = {}
        #: (owner type, method name or function id) -> (name or function, reason).
        self._bound: dict[tuple[type, Any], tuple[Any, str | None]] = {}
        self._homes: dict[tuple[str, bool], str | None] = {}
        self._named: dict[int, tuple[Any, str]] = {}
        self._bases: tuple[type, ...] = ()
        self._base_reasons: list[tuple[type, str]] = []
        self._methods: dict[str, list[tuple[type, str]]] = {}
        #: Classes whose instances pass although their home is refused (the tables'
        #: BRIDGE_VALUES and OPEN_CLASSES).
        self._exempt: dict[int, Any] = {}
        #: id -> (function, class): the OPEN_CLASSES' methods a caller may call.
        self._open_methods: dict[int, tuple[Any, type]] = {}
        #: id -> (container, reason): module namespaces and the tables' CONTAINERS.
        self._containers: dict[int, tuple[Any, str, str]] = {}
        self._modules_seen = -1
        self._refresh()

    # -- the entry points ---------------------------------------------------------------

    def check(self, value: Any, where: str) -> Any:
        """``value`` itself when a caller may reach it.

        Raises:
            BadArgument: naming ``where`` (the path step, the argument, the place in a
                reply), what ``value`` is, and which capability it is.
        """
        # reason(), inlined for the common cases: an ordinary instance, a known function.
        verdict = self._types.get(type(value), _MISSING)
        if verdict is None:
            return value
        if verdict is _EACH:
            entry = self._objects.get(id(value))
            if entry is not None and entry[0] is value:
                verdict = entry[1]
            else:
                verdict = self._judge(value)
        elif verdict is _MISSING:
            verdict = self.reason(value)
        if verdict is None:
            return value
        raise self.refusal(value, where, verdict)

    def refusal(self, value: Any, where: str, reason: str) -> BadArgument:
        """The error for ``value``, refused for ``reason``, found at ``where``."""
        entry = self._containers.get(id(value))
        what = entry[2] if entry is not None and entry[0] is value else describe(value)
        return BadArgument(
            f"{where} is {what}, which no caller may reach: {reason} (see docs/SECURITY.md)"
        )

    def reason(self, value: Any) -> str | None:
        """Why ``value`` is refused (a phrase of :mod:`guard_tables`), or ``None``."""
        verdict = self._types.get(type(value), _MISSING)
        if verdict is _MISSING:
            verdict = self._type_verdict(type(value))
        if verdict is not _EACH:
            return verdict
        entry = self._objects.get(id(value))
        if entry is not None and entry[0] is value:
            return entry[1]
        return self._judge(value)

    # -- verdicts ------------------------------------------------------------------------

    def _type_verdict(self, t: type) -> Any:
        self._refresh()
        if t in tables.REFUSED_TYPES:
            verdict: Any = tables.REFUSED_TYPES[t]
        elif t in _EACH_TYPES or t in _CONTAINER_TYPES or issubclass(t, _EACH_BASES):
            verdict = _EACH
        else:
            # An instance is what its class is (a logger, an open file, a bridge object).
            verdict = self._class_reason(t)
        if len(self._types) >= _CACHE_LIMIT:
            self._types.clear()
        self._types[t] = verdict
        return verdict

    def _judge(self, value: Any) -> str | None:  # noqa: C901 - one branch per kind
        """The verdict on one callable, class or module (cached when it is long-lived)."""
        t = type(value)
        if t is dict or t is list:  # most are ordinary; a few are the interpreter's
            self._refresh()
            entry = self._containers.get(id(value))
            return entry[1] if entry is not None and entry[0] is value else None
        # Bound methods first (new objects at each access, never named in the tables):
        # judged by their owner and their function, cached per owner type.
        if t is types.MethodType:
            owner, fn = value.__self__, value.__func__
            entry = self._bound.get((type(owner), id(fn)))
            if entry is not None and entry[0] is fn:
                return entry[1]
            return self._bound_reason(owner, fn)
        if t is types.BuiltinFunctionType:
            owner = value.__self__
            if owner is not None and not isinstance(owner, types.ModuleType):
                name = value.__name__  # tensor.sum, list.append
                entry = self._bound.get((type(owner), name))
                if entry is not None:
                    return entry[1]
                return self._bound_reason(owner, name)
        self._refresh()
        lasting = False
        named = self._named.get(id(value))
        if named is not None and named[0] is value:
            reason: str | None = named[1]
            lasting = True
        elif t is types.FunctionType:
            reason = self._function_reason(value)
            lasting = "<locals>" not in value.__qualname__
        elif isinstance(value, types.ModuleType):  # not cached: sys.modules may change
            name = getattr(value, "__name__", None)
            ok = name in self.allowed and sys.modules.get(name) is value
            reason = None if ok else tables.FOREIGN_MODULE
        elif isinstance(value, type):
            reason = self._class_reason(value)
            lasting = "<locals>" not in getattr(value, "__qualname__", "<locals>")
        elif t is types.BuiltinFunctionType:  # a C function of a module, or unbound
            reason = self._builtin_reason(value)
            lasting = True
        elif t in tables.METHOD_KINDS:  # method descriptors and wrappers: str.format, x.__add__
            reason = self._descriptor_reason(value)
            lasting = t is not types.MethodWrapperType
        elif isinstance(value, staticmethod):  # callable itself since Python 3.10
            reason = self.reason(value.__func__)
        elif isinstance(value, _LRU_WRAPPER):
            reason = self.reason(getattr(value, "__wrapped__", None))
        elif isinstance(value, functools.partial):  # what it calls and what it holds
            reason = None
            for part in (value.func, *value.args, *value.keywords.values()):
                reason = self.reason(part)
                if reason is not None:
                    break
        else:  # not reached: _EACH covers the kinds above only
            reason = tables.GENERIC_ACCESS
        if lasting:
            if len(self._objects) >= _CACHE_LIMIT:
                self._objects.clear()
                self.passed.clear()
            self._objects[id(value)] = (value, reason)
            if reason is None:
                self.passed[id(value)] = value
        return reason

    def _class_reason(self, cls: type) -> str | None:
        if id(cls) in self._exempt:
            return None
        named = self._named.get(id(cls))
        if named is not None and named[0] is cls:
            return named[1]
        if cls in tables.REFUSED_TYPES:
            return tables.REFUSED_TYPES[cls]
        return self._base_reason(cls) or self._home_reason(_home(cls), functions=False)

    def _base_reason(self, cls: type) -> str | None:
        try:
            if not issubclass(cls, self._bases):
                return None
        except TypeError:
            return None
        for base, reason in self._base_reasons:
            if issubclass(cls, base):
                return reason
        return None

    def _function_reason(self, fn: types.FunctionType) -> str | None:
        if fn.__name__.startswith("__"):
            return tables.DUNDER
        return self._home_reason(fn.__module__, functions=True)

    def _builtin_reason(self, fn: Any) -> str | None:
        """A C function: its module's (``posix.system``), or its ``__module__``'s."""
        if fn.__name__.startswith("__"):
            return tables.DUNDER
        reason = self._home_reason(getattr(fn, "__module__", None), functions=True)
        owner = fn.__self__
        if reason is None and isinstance(owner, types.ModuleType):
            reason = self._home_reason(owner.__name__, functions=True)
        return reason

    def _bound_reason(self, owner: Any, fn: Any) -> str | None:
        """A method bound to ``owner``: ``fn`` is a Python function (judged itself) or a
        C method's name (judged by :data:`~guard_tables.METHODS`). Cached per owner type
        and function while the owner's type decides for all its instances."""
        named = type(fn) is str
        key = (type(owner), fn if named else id(fn))
        entry = self._bound.get(key)
        if entry is not None and (named or entry[0] is fn):
            return entry[1]
        if named:
            reason = tables.DUNDER if fn.startswith("__") else None
            reason = reason or self.reason(owner) or self._method_reason(owner, fn)
        else:
            opened = self._open_methods.get(id(fn))
            if opened is not None and opened[0] is fn and isinstance(owner, opened[1]):
                reason = self.reason(owner)  # logger.info: refused home, open method
            else:
                reason = self.reason(fn) or self.reason(owner)
        verdict = self._types.get(type(owner), _EACH)
        lasting = named or "<locals>" not in getattr(fn, "__qualname__", "<locals>")
        if verdict is not _EACH and lasting:  # the owner's type decides for all instances
            if len(self._bound) >= _CACHE_LIMIT:
                self._bound.clear()
            self._bound[key] = (fn, reason)
        return reason

    def _descriptor_reason(self, fn: Any) -> str | None:
        name = getattr(fn, "__name__", "")
        if not isinstance(name, str) or name.startswith("__"):
            return tables.DUNDER
        owner = getattr(fn, "__objclass__", None)
        if owner is None:
            owner = getattr(fn, "__self__", None)
        return self.reason(owner) or self._method_reason(owner, name)

    def _method_reason(self, owner: Any, name: str) -> str | None:
        candidates = self._methods.get(name)
        if not candidates:
            return None
        cls = owner if isinstance(owner, type) else type(owner)
        for base, reason in candidates:
            if issubclass(cls, base):
                return reason
        return None

    def _home_reason(self, home: Any, functions: bool) -> str | None:
        if not isinstance(home, str):
            return None
        key = (home, functions)
        try:
            return self._homes[key]
        except KeyError:
            pass
        reason: str | None = None
        if home not in self.allowed:
            parts = home.split(".")
            for i in range(len(parts), 0, -1):
                prefix = ".".join(parts[:i])
                if functions and prefix in tables.FUNCTION_HOMES:
                    reason = tables.FUNCTION_HOMES[prefix]
                    break
                if prefix in tables.HOMES:
                    reason = tables.HOMES[prefix]
                    break
        self._homes[key] = reason
        return reason

    # -- the named tables, looked up in sys.modules as modules are imported -------------

    def _refresh(self) -> None:
        """Resolve the tables' named objects whose modules are imported by now. Cheap
        when nothing was imported since the last look; when something was, the caches go
        (an object named by a module imported since may have been judged before)."""
        if len(sys.modules) == self._modules_seen:
            return
        named = {}
        for module, attr, reason in tables.NAMED:
            obj = tables.lookup(module, attr)
            if obj is not _MISSING:
                named[id(obj)] = (obj, reason)
        bases = []
        for module, attr, reason in tables.BASES:
            cls = tables.lookup(module, attr)
            if isinstance(cls, type):
                bases.append((cls, reason))
        methods: dict[str, list[tuple[type, str]]] = {}
        for module, attr, names, reason in tables.METHODS:
            cls = tables.lookup(module, attr)
            if isinstance(cls, type):
                for name in names:
                    methods.setdefault(name, []).append((cls, reason))
        containers = {}
        for module_obj in list(sys.modules.values()):
            namespace = getattr(module_obj, "__dict__", None)
            if isinstance(module_obj, types.ModuleType) and type(namespace) is dict:
                label = f"the namespace of the module {module_obj.__name__!r}"
                containers[id(namespace)] = (namespace, tables.NAMESPACE, label)
        for module, attr, reason in tables.CONTAINERS:
            obj = tables.lookup(module, attr)
            if obj is not _MISSING:
                containers[id(obj)] = (obj, reason, f"{module}.{attr}")
        self._containers = containers
        exempt = {}
        for module, attr in tables.BRIDGE_VALUES:
            obj = tables.lookup(module, attr)
            if obj is not _MISSING:
                exempt[id(obj)] = obj
        open_methods = {}
        for module, attr, names in tables.OPEN_CLASSES:
            cls = tables.lookup(module, attr)
            if isinstance(cls, type):
                exempt[id(cls)] = cls
                for name in names:
                    fn = getattr(cls, name, None)
                    if fn is not None:
                        open_methods[id(fn)] = (fn, cls)
        self._open_methods = open_methods
        if (named.keys(), [b for b, _ in bases], exempt.keys()) != (
            self._named.keys(),
            [b for b, _ in self._base_reasons],
            self._exempt.keys(),
        ) or methods.keys() != self._methods.keys():
            self._types.clear()
            self._objects.clear()
            self.passed.clear()
            self._bound.clear()
        self._named, self._base_reasons, self._methods, self._exempt = (
            named,
            bases,
            methods,
            exempt,
        )
        self._bases = tuple(b for b, _ in bases)
        self._modules_seen = len(sys.modules)  # after the lookups (getattr may import)


def _home(cls: type) -> Any:
    return getattr(cls, "__module__", None)
