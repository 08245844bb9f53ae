"""The rules of the house for ``scheduler/``, read from the source with `ast` (nothing is
imported):

* no import cycle among the package's modules: the arrows run one way;
* no function-local import of a scheduler module (it hides a cycle, or an arrow the wrong way),
  and no ``importlib`` import of one anywhere (an arrow no reader of the imports sees), except
  in ``scheduler/cli/``, where deferring the torch-heavy imports keeps ``--help`` fast;
* no private name (``_x``) imported from, or read off, another scheduler module;
* no module over `MAX_LINES` lines, except those in `LONG_MODULES`, each with its reason;
* every public module (not ``__init__``, name not starting with ``_``) defines ``__all__``, and
  lists only names it defines.

The import graph has an edge from a module to each scheduler module it imports at run time:
``from pkg import name`` is an edge to ``pkg.name`` when that is a submodule, else to ``pkg``;
relative imports are resolved against the importing module's package; imports under
``if TYPE_CHECKING:`` do not run and are left out. Function-local imports are edges too (a
cycle closed inside a function is still a cycle). The implicit import of a parent package's
``__init__`` is not an edge (every submodule would otherwise close a cycle with its package).

The checks themselves are tested on small packages written to a temporary folder.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "scheduler"

MAX_LINES = 400
#: ``{path relative to the repository: why it may be longer than MAX_LINES}``
LONG_MODULES: dict[str, str] = {
    "scheduler/solvers/relaxation_memory.py":
        "the relaxation's memory constraints (forward, backward, recompute bursts) share one set "
        "of literals; split apart, each half would reach into the other's (5% over)",
    "scheduler/cost/simulate.py":
        "one pass over the step, forward then backward, with the owners and holds its "
        "per-region accounting reads in the same loop; split apart, the loop's invariants "
        "would live in two files (1% over)",
}
#: where function-local imports of the package are allowed (folders, relative to the repository)
LOCAL_IMPORTS_ALLOWED = ("scheduler/cli/",)


# ------------------------------------------------------------------------------ reading the source


@dataclass(frozen=True)
class Import:
    """One import of a package module by another: where it is and what it takes."""

    importer: str  # dotted module name
    target: str  # dotted module name of the imported package module
    path: str  # importer's file, relative to the root folder
    line: int
    #: ``from target import names`` (empty for ``import target`` and submodules)
    names: tuple[str, ...] = ()
    function: str | None = None  # the enclosing function, for a function-local import

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class Module:
    name: str
    path: Path
    rel: str  # path relative to the root folder, with "/"
    tree: ast.Module
    lines: int
    imports: list[Import] = field(default_factory=list)
    #: ``(line, alias, attribute)`` for every ``alias._private`` read off an imported module
    private_reads: list[tuple[int, str, str]] = field(default_factory=list)
    #: ``(line, argument, function)`` for every ``importlib.import_module`` (or ``__import__``)
    #: of what may be a package module: an arrow the import graph cannot see
    dynamic: list[tuple[int, str, str | None]] = field(default_factory=list)

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"

    @property
    def package(self) -> str:
        """The package that relative imports in this module start from."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


class Package(dict):
    """Modules by dotted name (with a short repr, for pytest's failure reports)."""

    def __repr__(self) -> str:
        return f"<{len(self)} modules>"


def read_package(root: Path, package: str) -> dict[str, Module]:
    """Every module of ``root/package`` by dotted name, with its imports of the package."""
    modules: dict[str, Module] = Package()
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        text = path.read_text()
        modules[name] = Module(name, path, path.relative_to(root).as_posix(),
                               ast.parse(text, filename=str(path)), len(text.splitlines()))
    for module in modules.values():
        _Imports(module, modules).visit(module.tree)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _Imports(ast.NodeVisitor):
    """Collects a module's run-time imports of package modules (see the module docstring)."""

    def __init__(self, module: Module, modules: dict[str, Module]):
        self.module, self.modules = module, modules
        self.functions: list[str] = []
        self.aliases: dict[str, str] = {}  # local name -> package module it is bound to

    def _add(self, node: ast.stmt, target: str, names: tuple[str, ...] = ()) -> None:
        m = self.module
        m.imports.append(Import(m.name, target, m.rel, node.lineno, names,
                                self.functions[-1] if self.functions else None))

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):  # not run: only the else branch counts
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name in self.modules:
                self._add(node, alias.name)
                if alias.asname:
                    self.aliases[alias.asname] = alias.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module.package.split(".")
            if node.level > 1:
                base = base[:-(node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        plain: list[str] = []
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            if sub in self.modules:  # a submodule
                self._add(node, sub)
                self.aliases[alias.asname or alias.name] = sub
            else:
                plain.append(alias.name)
        if plain and source in self.modules:
            self._add(node, source, tuple(plain))

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in ("import_module", "__import__") and node.args:
            arg, package = node.args[0], self.module.name.partition(".")[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                ours = arg.value == package or arg.value.startswith((f"{package}.", "."))
            elif isinstance(arg, ast.JoinedStr):
                text = ast.unparse(arg)
                ours = any(k in text for k in ("__package__", "__name__", "__spec__", package))
            else:
                ours = False
            if ours:
                self.module.dynamic.append((node.lineno, ast.unparse(arg),
                                            self.functions[-1] if self.functions else None))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if (isinstance(node.value, ast.Name) and node.value.id in self.aliases
                and _private(node.attr)):
            self.module.private_reads.append((node.lineno, node.value.id, node.attr))
        self.generic_visit(node)


# ------------------------------------------------------------------------------ the checks


def import_graph(modules: dict[str, Module]) -> nx.DiGraph:
    """Module -> imported package module, each edge with the imports that make it."""
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for m in modules.values():
        for imp in m.imports:
            if imp.target != m.name:
                if not g.has_edge(m.name, imp.target):
                    g.add_edge(m.name, imp.target, imports=[])
                g.edges[m.name, imp.target]["imports"].append(imp)
    return g


def import_cycles(modules: dict[str, Module]) -> list[str]:
    """Each elementary import cycle, shortest first, as ``a (path:line) -> b (...) -> a``."""
    g = import_graph(modules)
    out = []
    for cycle in sorted(nx.simple_cycles(g), key=lambda c: (len(c), c)):
        i = cycle.index(min(cycle))  # start at the same module however networkx listed it
        cycle = cycle[i:] + cycle[:i]
        steps = []
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            where = ", ".join(imp.where for imp in g.edges[a, b]["imports"])
            steps.append(f"{a} ({where})")
        out.append(" -> ".join(steps) + f" -> {cycle[0]}")
    return out


def local_imports(modules: dict[str, Module], allowed: tuple[str, ...] = ()) -> list[str]:
    """Function-local and dynamic (``importlib``) imports of package modules outside the
    ``allowed`` folders."""
    out = []
    for m in modules.values():
        if m.rel.startswith(allowed):
            continue
        out += [f"{imp.where}: {m.name} imports {imp.target} inside {imp.function}()"
                for imp in m.imports if imp.function is not None]
        out += [f"{m.rel}:{line}: {m.name} imports {arg} dynamically"
                + (f" inside {function}()" if function else "")
                for line, arg, function in m.dynamic]
    return sorted(out, key=lambda x: (x.split(":")[0], int(x.split(":")[1])))


def private_imports(modules: dict[str, Module]) -> list[str]:
    """Private names imported from, or read off, another package module."""
    out = []
    for m in modules.values():
        for imp in m.imports:
            parent, _, last = imp.target.rpartition(".")
            if _private(last) and parent != m.package:
                # (a private module is its own package's business)
                out.append(f"{imp.where}: {m.name} imports private module {imp.target}")
            elif imp.target != m.name:
                out.extend(f"{imp.where}: {m.name} imports private {name} from {imp.target}"
                           for name in imp.names if _private(name))
        for line, alias, attr in m.private_reads:
            out.append(f"{m.rel}:{line}: {m.name} reads private {alias}.{attr}")
    return out


def long_modules(modules: dict[str, Module], max_lines: int,
                 allowed: dict[str, str]) -> list[str]:
    return [f"{m.rel}: {m.lines} lines (more than {max_lines})"
            for m in modules.values() if m.lines > max_lines and m.rel not in allowed]


def _bound_names(body: list[ast.stmt]) -> set[str]:
    """Names a module body binds at its top level (inside top-level ``if``/``try`` too)."""
    names: set[str] = set()
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
        elif isinstance(stmt, ast.If):
            names |= _bound_names(stmt.body) | _bound_names(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            names |= _bound_names(stmt.body) | _bound_names(stmt.orelse)
            names |= _bound_names(stmt.finalbody)
            for h in stmt.handlers:
                names |= _bound_names(h.body)
    return names


def _all_of(tree: ast.Module) -> tuple[int, list[str] | None] | None:
    """``(line, names)`` of the module's ``__all__`` (names None when not a literal list of
    strings), or None without one."""
    for stmt in tree.body:
        targets = (stmt.targets if isinstance(stmt, ast.Assign)
                   else [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            try:
                value = ast.literal_eval(stmt.value)
            except ValueError:
                return stmt.lineno, None
            ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
            return stmt.lineno, list(value) if ok else None
    return None


def missing_all(modules: dict[str, Module]) -> list[str]:
    """Public modules without ``__all__``, or whose ``__all__`` names what they do not define."""
    out = []
    for m in modules.values():
        if m.is_package or m.name.rpartition(".")[2].startswith("_"):
            continue
        found = _all_of(m.tree)
        if found is None:
            out.append(f"{m.rel}: a public module without __all__")
            continue
        line, names = found
        if names is None:
            out.append(f"{m.rel}:{line}: __all__ is not a literal list of names")
            continue
        undefined = sorted(set(names) - _bound_names(m.tree.body))
        if undefined:
            out.append(f"{m.rel}:{line}: __all__ names {undefined}, which the module does not "
                       f"define")
    return out


# ------------------------------------------------------------------------------ the package


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    found = read_package(ROOT, PACKAGE)
    assert f"{PACKAGE}.plan" in found and len(found) > 20, sorted(found)  # (read the real one)
    return found


def _report(problems: list[str], what: str) -> str:
    return f"{len(problems)} {what}:\n  " + "\n  ".join(problems)


def test_no_import_cycles(modules: dict[str, Module]) -> None:
    cycles = import_cycles(modules)
    assert not cycles, _report(cycles, "import cycles (module (where it imports the next))")


def test_no_function_local_imports_of_the_package(modules: dict[str, Module]) -> None:
    found = local_imports(modules, LOCAL_IMPORTS_ALLOWED)
    assert not found, _report(found, "function-local or dynamic imports (move them to the "
                                     "top; if that makes a cycle, the arrow runs the wrong way)")


def test_no_private_names_across_modules(modules: dict[str, Module]) -> None:
    found = private_imports(modules)
    assert not found, _report(found, "private names used across modules (make them public, "
                                     "with a docstring, or move the code that needs them)")


def test_no_module_over_the_line_limit(modules: dict[str, Module]) -> None:
    found = long_modules(modules, MAX_LINES, LONG_MODULES)
    assert not found, _report(found, f"modules over {MAX_LINES} lines (split them, or add "
                                     f"them to LONG_MODULES with the reason)")
    stale = sorted(set(LONG_MODULES) - {m.rel for m in modules.values()
                                        if m.lines > MAX_LINES})
    assert not stale, f"LONG_MODULES lists modules that are no longer long, or gone: {stale}"


def test_every_public_module_has_all(modules: dict[str, Module]) -> None:
    found = missing_all(modules)
    assert not found, _report(found, "public modules without a good __all__")


# ------------------------------------------------------------------------------ the checks, checked


def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in {"pkg/__init__.py": "", **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return read_package(tmp_path, "pkg")


def test_a_two_module_cycle_is_found(tmp_path: Path) -> None:
    mods = _package(tmp_path, {
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "import os\n\nfrom pkg.a import thing\n",
        "pkg/c.py": "from .a import thing\n",  # into the cycle, not part of it
    })
    assert import_cycles(mods) == ["pkg.a (pkg/a.py:1) -> pkg.b (pkg/b.py:3) -> pkg.a"]


def test_a_cycle_through_subpackages_and_relative_levels_is_found(tmp_path: Path) -> None:
    mods = _package(tmp_path, {
        "pkg/x/__init__.py": "",
        "pkg/x/low.py": "def f():\n    from ..y.high import g\n",  # closed in a function
        "pkg/y/__init__.py": "from .high import g\n",
        "pkg/y/high.py": "from ..x import low\n",
    })
    assert import_cycles(mods) == [
        "pkg.x.low (pkg/x/low.py:2) -> pkg.y.high (pkg/y/high.py:1) -> pkg.x.low"]
    assert local_imports(mods) == [
        "pkg/x/low.py:2: pkg.x.low imports pkg.y.high inside f()"]
    assert local_imports(mods, ("pkg/x/",)) == []


def test_dynamic_imports_of_the_package_are_found(tmp_path: Path) -> None:
    mods = _package(tmp_path, {
        "pkg/reg.py": ("import importlib\n\ndef load(family):\n"
                       "    importlib.import_module(f'{__package__}.{family}')\n"
                       "    importlib.import_module('json')\n"
                       "importlib.import_module('pkg.reg')\n"),
    })
    assert local_imports(mods) == [
        "pkg/reg.py:4: pkg.reg imports f'{__package__}.{family}' dynamically inside load()",
        "pkg/reg.py:6: pkg.reg imports 'pkg.reg' dynamically",
    ]


def test_type_checking_imports_make_no_cycle(tmp_path: Path) -> None:
    mods = _package(tmp_path, {
        "pkg/d.py": ("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                     "    from .e import E, _secret\n"),
        "pkg/e.py": ("import typing\n\nfrom .d import D\nif typing.TYPE_CHECKING:\n"
                     "    from . import d\n_secret = 1\n"),
    })
    assert import_cycles(mods) == [] and private_imports(mods) == []
    assert [(i.importer, i.target) for m in mods.values() for i in m.imports] == [
        ("pkg.e", "pkg.d")]


def test_private_names_across_modules_are_found(tmp_path: Path) -> None:
    mods = _package(tmp_path, {
        "pkg/a.py": "_x = 1\n__version__ = '1'\n",
        "pkg/b.py": "from .a import _x, __version__\n",
        "pkg/c.py": "from . import a as mod\n\ny = mod._x\nz = mod.__name__\n",
        "pkg/_impl.py": "",
        "pkg/d.py": "from . import _impl\n",  # its own package's private module: fine
        "pkg/sub/__init__.py": "",
        "pkg/sub/e.py": "from .. import _impl\n",  # another package's: not
    })
    assert private_imports(mods) == [
        "pkg/b.py:1: pkg.b imports private _x from pkg.a",
        "pkg/c.py:3: pkg.c reads private mod._x",
        "pkg/sub/e.py:1: pkg.sub.e imports private module pkg._impl",
    ]


def test_long_modules_and_all_are_checked(tmp_path: Path) -> None:
    mods = _package(tmp_path, {
        "pkg/long.py": "__all__ = []\n" + "x = 1\n" * 5,
        "pkg/short.py": "__all__ = ['f', 'g']\n\ndef f():\n    pass\n",
        "pkg/bare.py": "def f():\n    pass\n",
        "pkg/_private.py": "",
    })
    assert long_modules(mods, 5, {}) == ["pkg/long.py: 6 lines (more than 5)"]
    assert long_modules(mods, 5, {"pkg/long.py": "a reason"}) == []
    assert missing_all(mods) == [
        "pkg/bare.py: a public module without __all__",
        "pkg/short.py:1: __all__ names ['g'], which the module does not define",
    ]
