"""The guard's policy as data (:mod:`~vllm_bridge.bridge.worker.guard`, docs/SECURITY.md).

Two kinds of table:

* what the *value* rule refuses: *capabilities*, never ordinary values: the objects
  through which a caller could run code of its own choosing, reach the interpreter or
  the operating system, touch attributes generically, or reach the worker's own
  machinery (``REFUSED_TYPES`` to ``BRIDGE_VALUES``);
* what the *call* rule allows beside code defined in an allow-listed module
  (:mod:`~vllm_bridge.bridge.worker.guard_calls`): the listed methods of value types, the
  builtin containers' constructors, calling a torch module (``CALLABLE_METHODS`` to
  ``CALLABLE_INSTANCES``); and which attributes of a handed-out logger a path may name
  (``OPEN_ATTRIBUTES``, :mod:`~vllm_bridge.bridge.worker.guard_steps`).

docs/SECURITY.md says why each group is here; a new entry needs a test in
``python/tests/bridge/test_security_*.py``.

Objects are named by module and dotted attribute (strings, not imports): the guard looks
them up in ``sys.modules`` only (:func:`lookup`), so naming ``numpy.load`` here never
imports numpy.
"""

from __future__ import annotations

import sys
import types
from typing import Any

#: The kinds of C method object: unbound (``str.upper``), class methods (``dict.fromkeys``
#: as found in the class), slot wrappers (``int.__add__``) and bound slot wrappers.
METHOD_KINDS = (
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
)

#: What :func:`lookup` returns for a module not imported (yet) or a missing attribute.
MISSING: Any = object()


def lookup(module: str, attr: str) -> Any:
    """The object named ``attr`` (dotted) in the imported module ``module``, or
    :data:`MISSING`; never imports anything."""
    obj: Any = sys.modules.get(module, MISSING)
    for part in attr.split("."):
        if obj is MISSING:
            break
        obj = getattr(obj, part, MISSING)
    return obj

# -- why something is refused (the last words of the bad_argument message) ------------------

INTROSPECTION = "interpreter introspection (frames, code, tracebacks, the interpreter's state)"
EVALUATION = "code evaluation, code generation or import"
OS_ACCESS = "operating-system access (files, processes, sockets, signals, threads)"
GENERIC_ACCESS = "generic attribute access or calls of whatever it is given"
WORKER = "the worker's own machinery (its logging, sessions, protocol or allow-list)"
FOREIGN_MODULE = "a module outside the allow-list"
NAMESPACE = (
    "a module's namespace or the interpreter's import and dispatch state (changing it "
    "changes what every call reaches)"
)
DUNDER = "a dunder method, which no path may name"

#: Types whose every instance is refused.
REFUSED_TYPES: dict[type, str] = {
    types.FrameType: INTROSPECTION,
    types.CodeType: INTROSPECTION,
    types.TracebackType: INTROSPECTION,
    types.CellType: INTROSPECTION,
}

#: Home modules (a function's ``__module__``, a C function's module, a class's
#: ``__module__`` and so its instances'): refused when the home is the module named or
#: inside it (``"os"`` covers ``os.path``). The most specific entry wins; ``None`` marks an
#: ordinary part of a refused package. An exactly allow-listed home is never refused: the
#: operator chose to trust that module's code.
HOMES: dict[str, str | None] = {
    # interpreter introspection
    **dict.fromkeys(
        (
            "sys", "gc", "inspect", "traceback", "linecache", "tracemalloc", "faulthandler",
            "dis", "pdb", "bdb", "trace", "atexit", "warnings", "_warnings", "site",
            "_sitebuiltins", "abc", "_abc", "cProfile", "profile", "_lsprof",
        ),
        INTROSPECTION,
    ),
    # code evaluation, generation, import, unpickling
    **dict.fromkeys(
        (
            "importlib", "_imp", "_frozen_importlib", "_frozen_importlib_external",
            "zipimport", "pkgutil", "runpy", "code", "codeop", "pickle", "_pickle", "marshal",
            "shelve", "copyreg", "ctypes", "_ctypes", "typing", "typing_extensions",
            "dataclasses", "pydoc", "timeit", "doctest", "unittest", "numpy.ctypeslib",
            "numpy.f2py", "numpy.distutils", "numpy._core._internal", "numpy.core._internal",
            "torch.serialization", "torch.hub", "torch.package", "torch.utils.cpp_extension",
            "torch.library", "torch._library", "torch._ops", "torch._utils", "torch._dynamo",
            "torch._inductor", "torch.jit._serialization", "torch.distributed.rpc",
        ),
        EVALUATION,
    ),
    # operating-system access
    **dict.fromkeys(
        (
            "os", "posix", "nt", "posixpath", "ntpath", "genericpath", "subprocess",
            "_posixsubprocess", "io", "_io", "fileinput", "filecmp", "socket", "_socket",
            "ssl", "_ssl", "select", "selectors", "shutil", "pathlib", "glob", "tempfile",
            "signal", "_signal", "pty", "tty", "termios", "mmap", "fcntl", "resource",
            "grp", "pwd", "platform", "getpass", "multiprocessing", "_multiprocessing",
            "_posixshmem", "concurrent", "asyncio", "threading", "_thread", "sched",
            "webbrowser", "http", "urllib", "ftplib", "smtplib", "xmlrpc", "socketserver",
            "zipfile", "tarfile", "gzip", "bz2", "lzma", "dbm", "sqlite3", "_sqlite3",
            "torch.multiprocessing", "torch.storage", "torch.cuda.gds",
            "numpy.lib.npyio", "numpy.lib._npyio_impl", "numpy.lib.format",
            "numpy.lib._datasource",
        ),
        OS_ACCESS,
    ),
    # generic attribute access and calls of whatever they are given
    **dict.fromkeys(
        (
            "functools", "_functools", "operator", "_operator", "string", "weakref",
            "_weakref", "_weakrefset",
        ),
        GENERIC_ACCESS,
    ),
    # the worker's own machinery: its logging (where its log handler and channel hang),
    # and the bridge's own packages (sessions, the allow-list, framing)
    **dict.fromkeys(
        (
            "logging",
            "vllm_bridge.bridge.worker",
            "vllm_bridge.bridge.protocol",
            "vllm_bridge.bridge.introspect",
        ),
        WORKER,
    ),
}

#: Like :data:`HOMES`, for functions only (classes and instances of these homes are
#: ordinary values): torch's private bindings, where TorchScript compilation and IR
#: loading live, beside public classes such as ``torch.Generator``.
FUNCTION_HOMES: dict[str, str | None] = {
    "torch._C": EVALUATION,
    # the operator namespaces torch.nn.functional and friends re-export
    **dict.fromkeys(
        (
            "torch._C._nn", "torch._C._fft", "torch._C._linalg", "torch._C._special",
            "torch._C._nested", "torch._C._sparse", "torch._C._VariableFunctions",
        ),
        None,
    ),
}

#: Objects refused by identity (module, dotted attribute, why), looked up once the module
#: is imported: what no home rule catches because its home is ordinary (``builtins``,
#: ``torch``, ``numpy``), and classes that would make new code or new classes.
NAMED: tuple[tuple[str, str, str], ...] = (
    *(
        ("builtins", name, EVALUATION)
        for name in ("eval", "exec", "compile", "__import__", "breakpoint", "help", "type")
    ),
    *(
        ("builtins", name, GENERIC_ACCESS)
        for name in ("getattr", "setattr", "delattr", "hasattr", "vars", "globals",
                     "locals", "dir")
    ),
    *(
        ("builtins", name, OS_ACCESS)
        for name in ("open", "input", "exit", "quit", "copyright", "credits", "license")
    ),
    *(
        ("types", name, EVALUATION)
        for name in ("FunctionType", "CodeType", "CellType", "ModuleType", "new_class",
                     "prepare_class")
    ),
    ("types", "FrameType", INTROSPECTION),
    ("types", "TracebackType", INTROSPECTION),
    ("contextvars", "copy_context", WORKER),
    *(
        ("torch", name, OS_ACCESS)
        for name in ("load", "save", "from_file", "UntypedStorage", "TypedStorage",
                     # static C methods: no __self__, no __module__ lead back to a class
                     "UntypedStorage.from_file", "TypedStorage.from_file",
                     "_C.StorageBase.from_file")
    ),
    ("torch.jit", "load", OS_ACCESS),
    ("torch.jit", "save", OS_ACCESS),
    ("torch.jit", "CompilationUnit", EVALUATION),
    ("torch._C", "import_ir_module", EVALUATION),
    ("torch._C", "import_ir_module_from_buffer", EVALUATION),
    *(
        ("numpy", name, OS_ACCESS)
        for name in ("load", "save", "savez", "savez_compressed", "savetxt", "loadtxt",
                     "genfromtxt", "fromfile", "fromregex", "memmap", "DataSource")
    ),
)

#: Containers refused by identity (module, dotted attribute, why), beside every module's
#: namespace (``vars(module)``, the builtins' included), which the guard adds itself:
#: a caller holding one could rewrite what other calls reach (``BUILTINS.update``,
#: ``sys.modules.update``) or remove the worker's log handler.
CONTAINERS: tuple[tuple[str, str, str], ...] = (
    *(
        ("sys", name, NAMESPACE)
        for name in ("modules", "path", "meta_path", "path_hooks", "path_importer_cache")
    ),
    ("copyreg", "dispatch_table", NAMESPACE),
    ("warnings", "filters", NAMESPACE),
    ("logging", "root.handlers", WORKER),
    ("logging", "Logger.manager.loggerDict", WORKER),
)

#: Classes whose subclasses and instances are refused (module, class, why): machinery
#: that subclasses elsewhere would otherwise carry out of its home.
BASES: tuple[tuple[str, str, str], ...] = (
    *(
        ("logging", name, WORKER)
        for name in ("Handler", "Filter", "Manager", "PlaceHolder", "LoggerAdapter",
                     "Formatter", "LogRecord")
    ),
    ("io", "IOBase", OS_ACCESS),  # every file object, whoever subclassed it
    ("socket", "socket", OS_ACCESS),
    ("subprocess", "Popen", OS_ACCESS),
    ("threading", "Thread", OS_ACCESS),
    ("multiprocessing.process", "BaseProcess", OS_ACCESS),
    ("string", "Formatter", GENERIC_ACCESS),
    ("contextvars", "Context", WORKER),  # a session's context, and Context.run calls anything
    ("contextlib", "ExitStack", GENERIC_ACCESS),  # callback() calls whatever it is given
    ("contextlib", "AsyncExitStack", GENERIC_ACCESS),
    ("torch._C", "StorageBase", OS_ACCESS),  # from_file, shared-memory file names
    ("torch", "UntypedStorage", OS_ACCESS),
    ("torch", "TypedStorage", OS_ACCESS),
    ("numpy", "memmap", OS_ACCESS),
)

#: Methods refused by name on instances (and subclasses) of a class, bound or unbound:
#: ``str.format`` walks attributes of its arguments (``"{0.__globals__}"``), and an
#: array's ``tofile``/``dump`` write any path.
METHODS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("builtins", "str", ("format", "format_map"), GENERIC_ACCESS),
    ("numpy", "ndarray", ("tofile", "dump", "dumps"), OS_ACCESS),
)

#: Classes of a refused home whose instances a caller may hold, and the methods it may
#: call on them (module, class, method names): what the forward-context API hands out
#: (``init_logger``, ``logger``; docs/SECURITY.md). A logger is a name and a level: it
#: may log and be asked about itself. What hangs from it (its handlers, the manager, the
#: root logger's handler list) and every method that changes it stay refused.
OPEN_CLASSES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "logging",
        "Logger",
        ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal",
         "log", "isEnabledFor", "getEffectiveLevel", "getChild", "hasHandlers"),
    ),
    ("logging", "RootLogger", ()),  # the root logger; its methods are the Logger's
)

#: Values of the bridge's own packages that are ordinary data, not machinery: wire value
#: types, and the exception a context manager's ``__exit__`` is handed.
BRIDGE_VALUES: tuple[tuple[str, str], ...] = (
    ("vllm_bridge.bridge.protocol.types", "Atom"),
    ("vllm_bridge.bridge.protocol.types", "Ref"),
    ("vllm_bridge.bridge.worker.sessions", "CallerError"),
)


# -- what may be called beside code of an allow-listed module (guard_calls.py) -------------

#: The rule a refused call is told, in its message.
CALL_RULE = (
    "only code defined in an allow-listed module, or a listed method of a tensor, torch "
    "module, array, container or logger, may be called"
)

#: Stands for "every public method of the class" (every attribute whose name does not
#: start with ``_`` and that is callable), less the exceptions named beside it.
PUBLIC = ("<every public method>",)

#: Methods of value types a caller may call, bound or unbound (module, class, method
#: names or PUBLIC, exceptions): the method's own ``__name__`` must be listed for the class
#: of its owner (an instance, or the class for a class method) or a base of it. What is
#: left out, and why (docs/SECURITY.md, "What may be called"):
#:
#: * a tensor's ``storage``/``untyped_storage``/``storage_type`` and ``set_`` (storages:
#:   ``from_file``, shared-memory file names), ``share_memory_`` (a shared-memory file),
#:   ``data_ptr``/``const_data_ptr`` (addresses); ``register_hook`` and
#:   ``register_post_accumulate_grad_hook`` (install code that runs later, inside other
#:   requests); ``apply_``/``map_``/``map2_`` (call a callable per element);
#:   ``as_subclass`` (makes the tensor an instance of a class of the caller's choosing,
#:   whose ``__torch_function__`` then runs on every operation);
#: * a torch module's ``compile`` (torch.compile: inductor runs a compiler with options of
#:   the caller's choosing), ``share_memory``, every ``register_*`` hook and
#:   ``register_buffer``/``register_parameter``/``register_module``/``add_module``/
#:   ``set_submodule`` (they install code or change the model's structure for every
#:   caller; ``load_state_dict`` changes its weights), and every private method
#:   (``_apply``, ``_call_impl``): only the names below;
#: * an array's ``tofile``/``dump`` (write any path) and ``dumps`` (a pickle);
#: * ``str.format``/``format_map`` (format fields walk attributes: ``"{0.__globals__}"``).
CALLABLE_METHODS: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    (
        "torch",
        "Tensor",
        PUBLIC,
        ("storage", "untyped_storage", "storage_type", "set_", "share_memory_", "data_ptr",
         "const_data_ptr", "register_hook", "register_post_accumulate_grad_hook", "apply_",
         "map_", "map2_", "as_subclass"),
    ),
    (
        "torch.nn",
        "Module",
        ("forward", "parameters", "named_parameters", "buffers", "named_buffers", "children",
         "named_children", "modules", "named_modules", "state_dict", "load_state_dict",
         "train", "eval", "requires_grad_", "zero_grad", "to", "cpu", "cuda", "float",
         "double", "half", "bfloat16", "get_submodule", "get_parameter", "get_buffer",
         "extra_repr", "apply"),
        (),
    ),
    ("numpy", "ndarray", PUBLIC, ("tofile", "dump", "dumps")),
    *(
        ("builtins", name, PUBLIC, ())
        for name in ("list", "dict", "set", "frozenset", "tuple", "bytes", "bytearray", "int",
                     "float", "complex", "bool")
    ),
    ("builtins", "str", PUBLIC, ("format", "format_map")),
    ("types", "GeneratorType", ("send", "throw", "close"), ()),
    ("types", "CoroutineType", ("send", "throw", "close"), ()),
    # and a logger's logging methods: OPEN_CLASSES' lists (below), read from there
)

#: Classes a caller may call to make an instance although their home is not allow-listed
#: (module, class): the builtin containers and scalars (``list[UBatchSlice]``, a type
#: alias of an allow-listed module, calls ``list``).
CALLABLE_CLASSES: tuple[tuple[str, str], ...] = tuple(
    ("builtins", name)
    for name in ("list", "dict", "set", "frozenset", "tuple", "str", "bytes", "bytearray",
                 "int", "float", "complex", "bool")
)

#: Classes whose instances a caller may call (module, class), as long as the instance's
#: ``__call__`` is the one the class defines or one defined in an allow-listed module:
#: calling a torch module runs its ``forward`` with its hooks.
CALLABLE_INSTANCES: tuple[tuple[str, str], ...] = (("torch.nn", "Module"),)

# -- which attributes a path may name on a handed-out object (guard_steps.py) --------------

#: Plain attributes of an OPEN_CLASSES instance a path may name, beside its listed methods:
#: every other step on it is refused (a logger's ``filters``, ``handlers``, ``_cache``,
#: ``parent``, ``manager``, ``root`` hand out what the worker's own logging runs on).
OPEN_ATTRIBUTES: tuple[str, ...] = ("name", "level", "propagate", "disabled")

#: Why a step is refused (the last words of the message).
PRIVATE = "a private name ('_...') defined outside the allow-list"
CLOSED = "an attribute of a handed-out object that no caller may reach"
