"""The package's import graph keeps the layout's promises (DESIGN.md, "Layout").

* No import circle among the modules of ``vllm_bridge`` (a circle works only as long as
  one particular module is imported first, as ``dp`` and its rendezvous helper did).
* The generic bridge (``vllm_bridge.bridge``) imports nothing of the forward-context
  system or the demo: statically (no module of it names one, at module level or inside a
  function) and at run time (importing every bridge module loads none of them).

The graph is read from the source (``ast``), so a test run imports nothing to build it.
An edge is a module-level import, to the imported module and each package above it
(importing ``a.b.c`` runs ``a`` and ``a.b`` first); imports under ``if TYPE_CHECKING:``
and inside functions are not edges of the graph (they run later, or never), but the
bridge's isolation check reads them too.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import vllm_bridge

PACKAGE_DIR = Path(vllm_bridge.__file__).resolve().parent
BRIDGE = "vllm_bridge.bridge"

#: The forward-context system and the demo: what the bridge must never load.
OUTSIDE_BRIDGE = (
    "vllm_bridge.forward_context",
    "vllm_bridge.dp",
    "vllm_bridge.cudagraph",
    "vllm_bridge.cudagraph_dispatch",
    "vllm_bridge.ubatch",
    "vllm_bridge.ubatch_wrapper",
    "vllm_bridge.ubatching",
    "vllm_bridge._ubatch_current",
    "vllm_bridge.sm_control",
    "vllm_bridge.batchsize",
    "vllm_bridge.config",
    "vllm_bridge.platforms",
    "vllm_bridge._checks",
    "vllm_bridge.demo",
)


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package in ``root`` (a directory named as its last part)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.Module, module_level: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree``: at module level only (not in functions or
    classes, nor under ``if TYPE_CHECKING:``), or every one."""
    if not module_level:
        return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            todo.extend(node.orelse if _is_type_checking(node.test) else node.body + node.orelse)
        elif isinstance(node, ast.Try):
            todo.extend(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                todo.extend(handler.body)
        elif isinstance(node, ast.With):
            todo.extend(node.body)
    return found


def imported(name: str, path: Path, modules: set[str], module_level: bool = True) -> set[str]:
    """The modules of ``modules`` that module ``name`` (source at ``path``) depends on
    when it is imported; never ``name`` itself.

    That is each module an import statement names, and the packages above it, whose
    ``__init__`` runs first, except the packages above ``name`` itself: those are being
    imported already when ``name`` runs (``from pkg import sub`` in a module of ``pkg``
    imports ``sub`` only; ``from pkg import name_defined_in_pkg`` needs ``pkg``).
    """
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    named: set[str] = set()
    for node in _import_nodes(tree, module_level):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
            continue
        if node.level:  # relative: from the module's package, up level - 1 more
            base = name.split(".")
            base = base[: len(base) - node.level + (1 if is_package else 0)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        subs = {f"{source}.{alias.name}" for alias in node.names} & modules
        named.update(subs)
        if source not in own_packages or len(subs) < len(node.names):
            named.add(source)  # a name defined in the package's __init__ (or any source)
    edges = set()
    for target in named:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            implied = i < len(parts)
            if prefix in modules and prefix != name and not (implied and prefix in own_packages):
                edges.add(prefix)
    return edges


def graph(root: Path, package: str) -> dict[str, set[str]]:
    files = module_files(root, package)
    names = set(files)
    return {name: imported(name, path, names) for name, path in files.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected part of more than one module (or a
    module importing itself), as the list of its modules; empty when there is none."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the package is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1 or v in edges.get(v, ()):
                found.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def outside_imports(root: Path, package: str, inside: str) -> dict[str, set[str]]:
    """For each module under ``inside``: the package's modules outside ``inside`` it
    imports anywhere (functions included), the top-level package excepted."""
    files = module_files(root, package)
    names = set(files)
    found = {}
    for name, path in files.items():
        if name == inside or name.startswith(inside + "."):
            bad = {
                m
                for m in imported(name, path, names, module_level=False)
                if m != package and not (m == inside or m.startswith(inside + "."))
            }
            if bad:
                found[name] = bad
    return found


# -- the finders find what they must (so the checks below can fail) ----------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_cycle_finder_finds_the_old_dp_circle_and_passes_its_cure(tmp_path):
    root = tmp_path / "pkg"
    _write(root, {
        "__init__.py": "",
        "dp/__init__.py": "from pkg.dp._rendezvous import rendezvous\n",
        "dp/_rendezvous.py": "from pkg import dp\n",  # the circle dp.py and its helper had
        "fc.py": "import pkg.dp\nif TYPE_CHECKING:\n    from pkg import late\n",
        "late.py": "from pkg import fc\n",  # only a TYPE_CHECKING edge closes this one
        "rel/__init__.py": "from . import a\n",
        "rel/a.py": "def f():\n    from . import b\n",  # inside a function: no edge
        "rel/b.py": "from .a import f\n",
    })
    assert cycles(graph(root, "pkg")) == [["pkg.dp", "pkg.dp._rendezvous"]]
    _write(root, {"dp/_rendezvous.py": "from typing import TYPE_CHECKING\n"
                  "if TYPE_CHECKING:\n    from pkg.dp import Info\n"})
    assert cycles(graph(root, "pkg")) == []
    _write(root, {"rel/b.py": "from . import a\n", "rel/a.py": "from .b import g\n"})
    assert cycles(graph(root, "pkg")) == [["pkg.rel.a", "pkg.rel.b"]]


def test_the_bridge_scan_finds_an_import_of_the_rest_anywhere_in_a_module(tmp_path):
    root = tmp_path / "pkg"
    _write(root, {
        "__init__.py": "",
        "fc.py": "",
        "demo/__init__.py": "",
        "bridge/__init__.py": "import pkg\n",
        "bridge/ok.py": "from pkg.bridge import lazy\nfrom .. import bridge\n",
        "bridge/lazy.py": "def f():\n    from pkg.demo import x\n",
        "bridge/rel.py": "from ..fc import thing\n",
    })
    assert outside_imports(root, "pkg", "pkg.bridge") == {
        "pkg.bridge.lazy": {"pkg.demo"},
        "pkg.bridge.rel": {"pkg.fc"},
    }


# -- the package ----------------------------------------------------------------------------


def test_no_import_circle_among_the_modules_of_vllm_bridge():
    edges = graph(PACKAGE_DIR, "vllm_bridge")
    assert {"vllm_bridge.dp", "vllm_bridge.dp._rendezvous", BRIDGE} <= set(edges)
    assert "vllm_bridge.dp._rendezvous" in edges["vllm_bridge.dp"]
    assert cycles(edges) == []


def test_the_top_level_package_imports_nothing():
    tree = ast.parse((PACKAGE_DIR / "__init__.py").read_text())
    assert [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] == []
    assert all(isinstance(m, str) for m in vllm_bridge.PUBLIC_MODULES)


def test_the_bridge_names_no_module_outside_it_but_the_top_level_package():
    assert outside_imports(PACKAGE_DIR, "vllm_bridge", BRIDGE) == {}


def test_importing_every_bridge_module_loads_no_forward_context_or_demo_module():
    bridge = sorted(m for m in module_files(PACKAGE_DIR, "vllm_bridge") if m.startswith(BRIDGE))
    assert "vllm_bridge.bridge.worker.server" in bridge and "vllm_bridge.bridge.diag" in bridge
    code = (
        "import importlib, json, sys\n"
        f"for name in {bridge!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('vllm_bridge'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert set(bridge) <= set(loaded)
    assert [m for m in loaded if m.startswith(OUTSIDE_BRIDGE)] == []
    assert [m for m in loaded if m != "vllm_bridge" and not m.startswith(BRIDGE)] == []
