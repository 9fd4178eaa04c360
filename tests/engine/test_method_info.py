"""The methods' facts are one torch-free table (`poros.engine.methods.method_info`): the runnable registry is built on
it, the report reads it, and no harness or suite module names a method by a string of its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from poros.config import Method
from poros.engine.methods.method_info import INFO, NAMES, PLANNED, REFERENCES, UNGATED, by_value, is_planned
from poros.engine.methods.registry import METHODS, MethodSpec

ROOT = Path(__file__).resolve().parents[2]


def test_registry_is_built_on_the_table():
    assert list(METHODS) == list(INFO) == list(Method)
    for m, spec in METHODS.items():
        assert {k: getattr(spec, k) for k in vars(INFO[m])} == vars(INFO[m])
        assert spec.in_process == (spec.factory is not None)
    assert NAMES == tuple(m.value for m in Method)
    assert PLANNED == "poros" and REFERENCES == ("resident", "resident_gc", "resident_gc_offload") and UNGATED == ("unsloth",)
    assert by_value("poros") is INFO[Method.POROS] and by_value("parity") is None
    assert is_planned("poros") and not is_planned("resident") and not is_planned("teleport")


def test_in_process_must_agree_with_a_factory():
    """Negative control: a method said to run in this process without a trainer factory is refused."""
    with pytest.raises(ValueError, match="in_process"):
        MethodSpec(**{**vars(INFO[Method.RESIDENT]), "in_process": True})
    MethodSpec(**{**vars(INFO[Method.UNSLOTH])})  # the accepted neighbour: a child-process method, no factory


def test_report_and_table_import_no_torch():
    code = ("import sys, poros.engine.methods.method_info, poros.harness.report, poros.harness.stacks; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def method_strings(source: str) -> list[tuple[int, str]]:
    """(line, name) of each string that is a method's name where code would compare or key by it: in a
    comparison, a membership test's collection, a dict key or a subscript."""
    names, found = set(NAMES), []

    def strings(node):
        return [n for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in names]

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            found += strings(node)
        elif isinstance(node, ast.Dict):
            found += [k for k in node.keys if isinstance(k, ast.Constant) and k.value in names]
        elif isinstance(node, ast.Subscript):
            found += strings(node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "setdefault"):
            found += [a for a in node.args[:1] if isinstance(a, ast.Constant) and a.value in names]
    return sorted((n.lineno, n.value) for n in found)


HARNESS = sorted([*(ROOT / "poros" / "harness").rglob("*.py"), *(ROOT / "suites").rglob("*.py")])


@pytest.mark.parametrize("path", HARNESS, ids=lambda p: str(p.relative_to(ROOT)))
def test_harness_names_no_method_by_string(path):
    assert method_strings(path.read_text()) == [], \
        f"{path}: compare with poros.engine.methods.method_info's facts instead"


def test_method_strings_finds_a_comparison():
    """Negative control: the check sees the forms it forbids, and passes a package version named `poros`."""
    bad = 'if r["method"] == "poros": pass\nx = {"unsloth": 1}\ny = c.get("resident")\nz = m in ("resident_gc",)\n'
    assert [name for _, name in method_strings(bad)] == ["poros", "unsloth", "resident", "resident_gc"]
    assert method_strings('ver("poros")\nlabel = "poros (blockwise residency)"\n') == []
