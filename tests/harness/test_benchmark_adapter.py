"""pytest-benchmark through its public surface: what the harness needs beyond it lives in one adapter module
(poros/harness/pytest_benchmark_adapter.py), checked here against the installed pytest-benchmark."""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

from pytest_benchmark.fixture import BenchmarkFixture
from pytest_benchmark.session import BenchmarkSession
from pytest_benchmark.stats import Metadata, Stats

from poros.harness import pytest_benchmark_adapter as adapter

ROOT = Path(__file__).resolve().parents[2]
INTERNALS = re.compile(r"_benchmarksession|_make_stats|stats\.stats|compared_mapping|performance_regressions")


def internal_uses(folders) -> dict[str, int]:
    """{file: lines that reach into pytest-benchmark's internals} under `folders`."""
    out = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            n = sum(1 for line in path.read_text().splitlines() if INTERNALS.search(line))
            if n:
                out[str(path.relative_to(ROOT))] = n
    return out


def test_pytest_benchmark_internals_are_reached_only_through_the_adapter():
    uses = internal_uses([ROOT / "poros", ROOT / "suites"])
    assert set(uses) == {"poros/harness/pytest_benchmark_adapter.py"}, uses  # the adapter itself: the control


def test_the_internals_the_adapter_names_exist_in_the_installed_pytest_benchmark():
    """Where a pytest-benchmark release renames one, this fails naming it (the adapter was checked against
    CHECKED); the control is the check itself finding each on a real object."""
    assert adapter.CHECKED == "5.3.1"
    assert hasattr(BenchmarkFixture, "_make_stats") and hasattr(BenchmarkFixture, "pedantic")
    stats = Stats()
    stats.update(1.5)
    assert stats.data == [1.5] and Metadata.__init__.__code__.co_varnames[:2] == ("self", "fixture")
    for name in ("benchmarks", "compare", "storage", "performance_regressions"):
        assert name in BenchmarkSession.__init__.__code__.co_names, name
    assert BenchmarkSession.compared_mapping is None
    assert md.version("pytest-benchmark").split(".")[0] == adapter.CHECKED.split(".")[0]


def test_one_test_matrix_py_the_suites_own():
    """The matrix suite is poros/suites/test_matrix.py (suites/test_matrix.py collects it in a checkout under the same
    ids); the tests of it have a name of their own."""
    found = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("test_matrix.py")
                   if not {".venv", ".git", "build"} & set(p.relative_to(ROOT).parts))
    assert found == ["poros/suites/test_matrix.py", "suites/test_matrix.py"], found
