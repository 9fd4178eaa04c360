"""The package's import graph, read from every import statement (at module top, inside a function, or under
TYPE_CHECKING): every import of the package names one of its modules (none left under a moved module's old name); no
two modules import each other, however long the way round; the engine's modules live in its subpackages, one folder a
concern; and each of the engine's folders imports only the folders listed after it in poros/engine/__init__.py."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "poros"
# the engine's folders, top to bottom: each imports only those after it (poros/engine/__init__.py says the same)
ENGINE_FLOORS = ("verify", "methods", "runtime", "model", "parallel", "planning")


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package at `root`, by dotted name (a package by its own name, for its __init__.py)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that module `name` (at `path`) imports: `from X import Y` counts as an import of
    module X.Y where there is one, else of X; relative imports are resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the package at `root` and the package's modules it imports."""
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle of imports (a -> ... -> a) for each group of modules that reach each other (Tarjan's strongly
    connected components, iteratively), each written from its alphabetically first module."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(group)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(_way_round(graph, group) for group in groups)


def _way_round(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest way from the group's first module back to itself, through the group (breadth first)."""
    first = min(group)
    came_from = {first: None}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & group):
                if child == first:
                    way = [node]
                    while came_from[way[-1]] is not None:
                        way.append(came_from[way[-1]])
                    return [*reversed(way), first]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{sorted(group)} is no circle")


def loose_modules(folder: Path) -> list[str]:
    """The modules directly in `folder` other than its __init__.py: in the engine, each belongs in a subpackage."""
    return sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")


def floor_breaches(graph: dict[str, set[str]], engine: str, floors: tuple[str, ...]) -> list[str]:
    """`a -> b` for each import of a module in one of the engine's `floors` by a module of a floor below it."""
    def floor(module: str) -> int | None:
        parts = module.split(".")
        depth = len(engine.split("."))
        return floors.index(parts[depth]) if module.startswith(engine + ".") and parts[depth] in floors else None

    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if floor(a) is not None and floor(b) is not None and floor(b) < floor(a))


def missing_modules(files: list[Path], modules: dict[str, Path], package: str = "poros") -> list[str]:
    """`file:line imports MODULE` for each absolute import of a module of `package` that `modules` has not (a module
    moved or renamed, its old name still imported)."""
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            bad += [f"{path}:{node.lineno} imports {n}" for n in names
                    if (n == package or n.startswith(package + ".")) and n not in modules]
    return bad


def test_no_module_of_the_package_imports_itself_round_a_circle():
    found = circles(import_graph(PACKAGE))
    assert found == [], "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_every_import_of_the_package_names_one_of_its_modules():
    folders = ("poros", "tests", "suites", "scripts", "experiments")
    files = [p for folder in folders for p in (ROOT / folder).rglob("*.py")]
    assert missing_modules(sorted(files), module_names(PACKAGE)) == []


def test_the_engine_keeps_its_modules_in_subpackages():
    assert loose_modules(PACKAGE / "engine") == []
    assert sorted(p.parent.name for p in (PACKAGE / "engine").glob("*/__init__.py")) == sorted(ENGINE_FLOORS)


def test_each_engine_folder_imports_only_the_folders_below_it():
    assert floor_breaches(import_graph(PACKAGE), "poros.engine", ENGINE_FLOORS) == []


def test_the_engine_docstring_lists_its_folders_in_floor_order():
    doc = ast.get_docstring(ast.parse((PACKAGE / "engine" / "__init__.py").read_text()))
    listed = [line.split("`")[1] for line in doc.splitlines() if line.startswith("- `")]
    assert tuple(listed) == ENGINE_FLOORS, listed


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_circle_in_a_synthetic_package_is_found(tmp_path):
    """Negative control: a circle of three modules (one import at the top, one relative, one inside a function),
    and one of two through `from package import module`, are found; the modules beside them that only import
    down, or import a module whose name only begins alike, are not in any."""
    pkg = _write(tmp_path / "pkg", {
        "__init__.py": "",
        "a.py": "import pkg.b\n",
        "b.py": "from .sub import c\n",
        "sub/__init__.py": "",
        "sub/c.py": "def late():\n    from pkg import a\n",
        "d.py": "from pkg import e\nimport pkg.a\n",
        "e.py": "from pkg.d import something\n",
        "f.py": "import pkg.b\nimport pkg.aa\n",
        "aa.py": "",
    })
    assert circles(import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"], ["pkg.d", "pkg.e", "pkg.d"]]


def test_a_package_without_a_circle_has_none(tmp_path):
    """Negative control's other side: a diamond (two ways down to one module) is no circle."""
    pkg = _write(tmp_path / "pkg", {"__init__.py": "", "top.py": "from pkg import left, right\n",
                                    "left.py": "import pkg.bottom\n", "right.py": "from . import bottom\n",
                                    "bottom.py": "import os\n"})
    assert circles(import_graph(pkg)) == []


def test_a_module_loose_in_the_engine_and_an_import_up_a_floor_are_found(tmp_path):
    """Negative control: a module directly in the engine folder is named, and so is an import of a higher floor's
    module from a lower floor's, where the same import downward is not."""
    engine = _write(tmp_path / "engine", {
        "__init__.py": "", "stray.py": "",
        "runtime/__init__.py": "", "runtime/buffers.py": "from engine.methods import trainer\n",
        "methods/__init__.py": "", "methods/trainer.py": "from engine.runtime.buffers import x\n",
    })
    assert loose_modules(engine) == ["stray.py"]
    graph = import_graph(engine)
    assert floor_breaches(graph, "engine", ENGINE_FLOORS) == ["engine.runtime.buffers -> engine.methods.trainer"]


def test_an_import_of_a_module_that_moved_is_found(tmp_path):
    """Negative control: imports of a module by its old name (at the top and inside a function) are named; an import
    of a name from a module that exists, and of another package whose name only begins alike, are not."""
    tool = tmp_path / "tool.py"
    tool.write_text("from poros.engine.trainer import Trainer\nimport porosity\n"
                    "from poros.engine.methods.trainer import Trainer as T\ndef f():\n    import poros.engine.parity\n")
    assert missing_modules([tool], module_names(PACKAGE)) == [f"{tool}:1 imports poros.engine.trainer",
                                                              f"{tool}:5 imports poros.engine.parity"]
