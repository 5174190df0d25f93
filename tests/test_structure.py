"""Structure of the tiertrain package: no import cycles between its modules, and packages
that import only the packages declared below them.

The check reads the source with ``ast`` and imports nothing, so it also works while a module
is broken. Each file under ``tiertrain/`` is a module (a package's ``__init__.py`` is the
module named after the package). Its dependencies are every import of another tiertrain
module, in any of the forms ``import tiertrain.x``, ``from tiertrain.x import y``,
``from .x import y``, ``from ..x import y`` and ``from . import x``, wherever it stands
(imports inside functions count: a lazy import that dodges a cycle is still a cycle), except
under ``if TYPE_CHECKING:``, which never runs.

What an import depends on, following what Python executes:

* the module it names, and for ``from P import name``, also the submodule ``P.name`` if
  there is one;
* the ``__init__`` of every package on the way to it (Python runs ``tiertrain/io/
  __init__.py`` before ``tiertrain/io/swap.py``), *except the importer's own ancestor
  packages*. Those are always initialised, or being initialised, before the importer runs,
  so an edge to them says nothing about import order; counting it would turn every package
  whose ``__init__`` re-exports its submodules into a cycle with each submodule
  (``io/__init__ -> io/swap -> io/__init__``), whether or not anything breaks;
* but an import that reads a *name defined by* an ancestor's ``__init__`` (``from . import
  NVMeAdamW``, not a submodule) does depend on that ``__init__``: if the ``__init__`` is
  still running the import that led here, the name is not there yet. That edge is kept, and
  reported as a cycle when the ``__init__`` imports the importer.

A cycle is a strongly connected component of that graph with more than one module (or a
module importing itself); the failure lists each elementary cycle as ``a -> b -> a``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "tiertrain"
MAX_CYCLES_PER_COMPONENT = 50  # a dense component has exponentially many; the first ones suffice


# -- the module graph ---------------------------------------------------------------------------

def find_modules(package_root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under package_root (a package's
    __init__.py is named after the package)."""
    modules = {}
    for path in sorted(package_root.rglob("*.py")):
        parts = (package_root.name,) + path.relative_to(package_root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking_guard(node: ast.If) -> bool:
    test = node.test
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom in the tree, at any depth, except in ``if TYPE_CHECKING:``
    bodies (their ``else:`` branches do run, so they are searched)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking_guard(node):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _absolute_target(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, with relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    package = importer if is_package else importer.rpartition(".")[0]
    parts = package.split(".")
    base = ".".join(parts[:len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _with_packages_on_the_way(target: str, importer: str, modules: dict[str, Path]) -> set[str]:
    """`target` and the __init__ of each package Python runs to reach it, leaving out the
    importer's own ancestors (see the module docstring)."""
    parts = target.split(".")
    on_the_way = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {name for name in on_the_way if name in modules} - _ancestors(importer)


def module_dependencies(importer: str, path: Path, modules: dict[str, Path], root_package: str) -> set[str]:
    """The modules of `modules` that `importer` (source at `path`) imports."""
    is_package = path.name == "__init__.py"
    dependencies: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                dependencies |= _with_packages_on_the_way(alias.name, importer, modules)
            continue
        target = _absolute_target(importer, is_package, node)
        dependencies |= _with_packages_on_the_way(target, importer, modules)
        for alias in node.names:
            submodule = f"{target}.{alias.name}"
            if submodule in modules:
                dependencies.add(submodule)
            elif target in _ancestors(importer) and target in modules:
                dependencies.add(target)  # a name an ancestor's __init__ defines
    dependencies.discard(importer)
    return {name for name in dependencies if name == root_package or name.startswith(root_package + ".")}


def import_graph(package_root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = find_modules(package_root)
    return {name: module_dependencies(name, path, modules, package_root.name) for name, path in modules.items()}


# -- cycles ------------------------------------------------------------------------------------

def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit), each component sorted."""
    index_of: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    for root in sorted(graph):
        if root in index_of:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index_of[root] = lowlink[root] = len(index_of)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index_of:
                    index_of[successor] = lowlink[successor] = len(index_of)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    advanced = True
                    break
                if successor in on_stack:
                    lowlink[node] = min(lowlink[node], index_of[successor])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                lowlink[parent] = min(lowlink[parent], lowlink[node])
            if lowlink[node] == index_of[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def elementary_cycles(graph: dict[str, set[str]], component: list[str], limit: int) -> list[list[str]]:
    """The elementary cycles within one component, each starting at its smallest module, at
    most `limit` of them."""
    members = set(component)
    cycles: list[list[str]] = []
    for start in component:  # sorted: a cycle is found from its smallest member only
        allowed = {m for m in members if m >= start}
        path = [start]
        work = [iter(sorted(graph.get(start, set()) & allowed))]
        while work and len(cycles) < limit:
            successor = next(work[-1], None)
            if successor is None:
                work.pop()
                path.pop()
            elif successor == start:
                cycles.append(path + [start])
            elif successor not in path:
                path.append(successor)
                work.append(iter(sorted(graph.get(successor, set()) & allowed)))
    return cycles[:limit]


def import_cycles(graph: dict[str, set[str]], limit: int = MAX_CYCLES_PER_COMPONENT) -> list[str]:
    """Every import cycle as 'a -> b -> a' (at most `limit` per strongly connected component)."""
    found = []
    for component in strongly_connected_components(graph):
        if len(component) > 1 or component[0] in graph.get(component[0], ()):
            cycles = elementary_cycles(graph, component, limit)
            found += [" -> ".join(cycle) for cycle in cycles]
            if len(cycles) == limit:
                found.append(f"(more cycles among {', '.join(component)})")
    return found


# -- the tests ---------------------------------------------------------------------------------

IO_PACKAGE = "tiertrain.io"
IO_LEAVES = ("tiertrain.device", "tiertrain.errors", "tiertrain.spans", "tiertrain.waits")
"""The only modules outside tiertrain.io that the file IO stack may reach: leaves, which import
no tiertrain module but each other (device placement and copies, the error family, timing
spans, the run's timeout and wait clocks)."""


def test_the_io_package_imports_nothing_above_it():
    """tiertrain.io (asynchronous file IO, the aligned buffer pool, swap files, durable writes)
    is the layer below the tiers: its modules, and whatever they import in turn, import no
    tiertrain module outside tiertrain.io except the leaves of IO_LEAVES. A tier, a ZeRO stage,
    a checkpoint or the launcher may use it; it never uses them, not even through a lazy import
    inside a function."""
    graph = import_graph(PACKAGE_ROOT)
    io_modules = {name for name in graph if name == IO_PACKAGE or name.startswith(IO_PACKAGE + ".")}
    assert {f"{IO_PACKAGE}.{name}" for name in ("aio", "buffers", "swap", "fileio")} <= io_modules
    allowed = io_modules | set(IO_LEAVES)
    reached, stack = set(), sorted(io_modules)
    while stack:
        module = stack.pop()
        if module in reached:
            continue
        reached.add(module)
        stack += sorted(graph.get(module, set()) & allowed)
    above = [f"{module} imports {dependency}" for module in sorted(reached)
             for dependency in sorted(graph.get(module, set()) - allowed)]
    assert not above, ("the file IO stack reaches above itself (pass the thing in, or move it down into "
                       "tiertrain.io or a leaf):\n  " + "\n  ".join(above))


PACKAGE_LAYERS = ("io", "data", "offload", "zero", "update", "models", "parallel", "pipeline", "state", "estimate",
                  "observe", "trainer", "integrations", "cli")
"""tiertrain's packages from the bottom up: the file IO stack; the data pipeline; the tiers
(parameter stores, activations); the ZeRO core (flat layout, gradient reduction, stage-3
fetching); the optimizer-step forms; models; tensor parallelism; pipeline parallelism;
checkpoints, resharding and exports; the estimator and planner; observability; the trainer;
integrations; the command line. A package imports only packages before it (and top-level
modules, whose own cycles test_no_import_cycles finds)."""


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE_ROOT / parts[1]).is_dir() else None


def test_every_package_has_a_layer():
    packages = sorted(p.name for p in PACKAGE_ROOT.iterdir() if p.is_dir() and any(p.glob("*.py")))
    assert sorted(PACKAGE_LAYERS) == packages, "declare each package's place in PACKAGE_LAYERS"


def test_packages_import_only_the_packages_below_them():
    """Folders are layers: an import from a package to one declared above it (or a cycle of
    packages, which such an import always closes) fails, lazy imports inside functions
    included."""
    graph = import_graph(PACKAGE_ROOT)
    rank = {name: k for k, name in enumerate(PACKAGE_LAYERS)}
    upward = []
    for module, dependencies in sorted(graph.items()):
        source = _package_of(module)
        for dependency in sorted(dependencies):
            target = _package_of(dependency)
            if source is not None and target is not None and rank[target] > rank[source]:
                upward.append(f"{module} ({source}) imports {dependency} ({target})")
    assert not upward, (f"{len(upward)} import(s) against the layers {' < '.join(PACKAGE_LAYERS)} (move the thing "
                        f"down, or pass it in from above):\n  " + "\n  ".join(upward))


def test_no_import_cycles():
    cycles = import_cycles(import_graph(PACKAGE_ROOT))
    assert not cycles, f"{len(cycles)} import cycle(s) between tiertrain modules:\n  " + "\n  ".join(cycles)


def test_cycle_finder_reports_each_cycle_of_a_graph():
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c", "e"}, "e": set(), "f": {"f"}, "g": {"a"}}
    assert sorted(import_cycles(graph)) == ["a -> b -> a", "c -> d -> c", "f -> f"]
    triangle_with_chord = {"a": {"b"}, "b": {"c", "a"}, "c": {"a"}}
    assert sorted(import_cycles(triangle_with_chord)) == ["a -> b -> a", "a -> b -> c -> a"]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for relative, source in files.items():
        path = root / "pkg" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root / "pkg"


def test_import_graph_reads_every_import_form(tmp_path):
    package = _write_package(tmp_path, {
        "__init__.py": "from .core import run\nfrom .sub import helper\n",
        "core.py": "from . import util\nfrom .sub.helper import help_me\n",
        "util.py": "def later():\n    from pkg.core import run  # lazy, still a dependency\n",
        "typed.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .core import run\n"
                     "else:\n    import pkg.util\n"),
        "sub/__init__.py": "from .helper import help_me\n",
        "sub/helper.py": "from ..sub import other\nimport os\n",
        "sub/other.py": "from . import help_me  # a name sub/__init__ defines\n",
    })
    graph = import_graph(package)
    assert graph == {
        "pkg": {"pkg.core", "pkg.sub", "pkg.sub.helper"},
        "pkg.core": {"pkg.util", "pkg.sub", "pkg.sub.helper"},
        "pkg.util": {"pkg.core"},
        "pkg.typed": {"pkg.util"},
        "pkg.sub": {"pkg.sub.helper"},
        "pkg.sub.helper": {"pkg.sub.other"},
        "pkg.sub.other": {"pkg.sub"},
    }
    assert sorted(import_cycles(graph)) == [
        "pkg.core -> pkg.util -> pkg.core",
        "pkg.sub -> pkg.sub.helper -> pkg.sub.other -> pkg.sub",
    ]


@pytest.mark.parametrize("source", ["from .. import b\n", "from ..b import thing\n", "import pkg.b\n",
                                    "def f():\n    from pkg import b\n"])
def test_a_cycle_through_a_temporary_package_is_reported(tmp_path, source):
    package = _write_package(tmp_path, {"__init__.py": "", "b.py": "from .a.c import x\n",
                                        "a/__init__.py": "", "a/c.py": source})
    assert import_cycles(import_graph(package)) == ["pkg.a.c -> pkg.b -> pkg.a.c"]


LONGEST_LINES, LONG_LINES, MOST_LONG_FILES = 800, 600, 3


def test_files_stay_short_and_the_long_ones_are_named_in_the_readme():
    """No module of tiertrain/ is over 800 lines; at most three are over 600, and the README's
    "How it works" section names each of them (the place that says why it reads better whole)."""
    lengths = {path.relative_to(PACKAGE_ROOT.parent).as_posix(): len(path.read_text().splitlines())
               for path in PACKAGE_ROOT.rglob("*.py")}
    too_long = {path: n for path, n in lengths.items() if n > LONGEST_LINES}
    assert not too_long, f"split these modules (over {LONGEST_LINES} lines): {too_long}"
    long = {path: n for path, n in lengths.items() if n > LONG_LINES}
    assert len(long) <= MOST_LONG_FILES, f"more than {MOST_LONG_FILES} modules over {LONG_LINES} lines: {long}"
    readme = (PACKAGE_ROOT.parent / "README.md").read_text()
    section = readme[readme.index("## How it works"):]
    section = section[:section.index("\n## ", 1)]
    unnamed = [path for path in long if f"`{path.removeprefix('tiertrain/')}`" not in section]
    assert not unnamed, f"modules over {LONG_LINES} lines the README's How it works does not name: {unnamed}"
