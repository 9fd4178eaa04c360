"""Every name a function uses is defined: the GPU-only tests and the device scripts never run on a CPU
machine, so a missing import there would first show on the GPU. Checked statically here, for every
module of the project."""

from __future__ import annotations

import builtins
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(p for d in ("poros", "tests", "scripts", "suites") for p in (ROOT / d).rglob("*.py"))


def undefined_names(source: str, filename: str) -> set[str]:
    """Global names read inside functions that neither the module nor builtins define."""
    top = symtable.symtable(source, filename, "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()} | set(dir(builtins))
    missing: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for child in table.get_children():
            kind = getattr(child.get_type(), "value", child.get_type())  # a str, an enum from Python 3.13
            if kind in ("function", "class"):
                for s in child.get_symbols():
                    if s.is_referenced() and s.is_global() and not s.is_assigned() and s.get_name() not in defined:
                        missing.add(s.get_name())
            walk(child)

    walk(top)
    return missing - {"__file__", "__name__", "__class__"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_is_defined(path):
    assert not undefined_names(path.read_text(), str(path)), f"{path.name}: undefined names"


def test_check_finds_a_missing_import():  # negative control: the check can fail
    source = "def f():\n    return Placement('tail')\n"
    assert undefined_names(source, "x.py") == {"Placement"}
    assert not undefined_names("from poros.settings import Placement\n" + source, "x.py")
