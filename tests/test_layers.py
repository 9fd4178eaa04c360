"""The package's layers, read from every import statement (at module top or inside a function): training
(`poros/finetune`) and the benchmark harness (`poros/harness`) are siblings over the engine, and what both need
lives below both (`poros/common`); below the engine, the store and the models import nothing above them. No tool
(the package, its suites, scripts/) imports test code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "poros"
ABOVE_ENGINE = ("poros.harness", "poros.finetune", "poros.cli")
# a folder of the package: the packages none of its modules may import
RULES = {
    "common": ("poros.models", "poros.store", "poros.engine", *ABOVE_ENGINE),
    "models": ("poros.store", "poros.engine", *ABOVE_ENGINE),
    "store": ("poros.engine", *ABOVE_ENGINE),
    "engine": ABOVE_ENGINE,
    "finetune": ("poros.harness", "poros.cli"),
    "harness": ("poros.finetune", "poros.cli"),
}


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import in a module of `package` (relative imports resolved against it)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            name = ".".join(x for x in (base, node.module) if x)
            out += [(node.lineno, f"{name}.{a.name}" if node.module is None else name) for a in node.names]
    return out


def forbidden_imports(folder: Path, forbidden: tuple[str, ...], package: str) -> list[str]:
    """`file:line imports MODULE` for each import under `folder` of a module in (or below) one of `forbidden`."""
    bad = []
    for path in sorted(folder.rglob("*.py")):
        sub = ".".join((package, *path.relative_to(folder).parent.parts))
        for line, module in imported_modules(path, sub):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                bad.append(f"{path}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("folder", sorted(RULES), ids=lambda f: f"package=poros.{f}")
def test_no_module_imports_a_layer_above_its_own(folder):
    assert forbidden_imports(PACKAGE / folder, RULES[folder], f"poros.{folder}") == []


@pytest.mark.parametrize("folder", ["poros", "suites", "scripts", "experiments"], ids=lambda f: f"tools={f}")
def test_no_tool_imports_test_code(folder):
    assert forbidden_imports(ROOT / folder, ("tests",), folder) == []


def test_an_import_of_the_harness_from_training_is_found(tmp_path):
    """Negative control: a training module importing the harness, at its top, inside a function or relatively,
    is named; its neighbours importing the shared layer below, or a package whose name only begins alike, are not."""
    pkg = tmp_path / "finetune"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "ok.py").write_text("from poros.common.yamlfile import load_yaml\nimport poros.harnesses\n")
    (pkg / "top.py").write_text("from poros.harness.matrix import load_matrix\n")
    (pkg / "late.py").write_text("def f():\n    import poros.harness.results\n")
    (pkg / "sub" / "rel.py").write_text("from ...harness import bench\n")
    bad = forbidden_imports(pkg, RULES["finetune"], "poros.finetune")
    assert bad == [f"{pkg / 'late.py'}:2 imports poros.harness.results",
                   f"{pkg / 'sub' / 'rel.py'}:1 imports poros.harness",
                   f"{pkg / 'top.py'}:1 imports poros.harness.matrix"], bad


def test_an_import_of_test_code_from_a_tool_is_found(tmp_path):
    """Negative control: a script importing the tests' fixtures is named."""
    (tmp_path / "tool.py").write_text("import sys\nfrom tests.fixtures import tiny_checkpoint\n")
    assert forbidden_imports(tmp_path, ("tests",), "scripts") == [f"{tmp_path / 'tool.py'}:2 imports tests.fixtures"]
