"""ruff's pyflakes checks over the whole project: GPU-only tests and device scripts never run on a CPU
machine, so an undefined name there would otherwise first show on the GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
requires_ruff = pytest.mark.skipif(shutil.which("ruff") is None, reason="requires ruff (pip install -e '.[dev]')")


def _ruff(*paths: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(["ruff", "check", "--no-cache", *map(str, paths)], cwd=ROOT, capture_output=True, text=True)


@requires_ruff
def test_the_project_passes_ruff():
    done = _ruff("poros", "tests", "suites", "scripts", "experiments", "conftest.py")
    assert done.returncode == 0, done.stdout + done.stderr


@requires_ruff
def test_ruff_finds_an_undefined_name(tmp_path):  # negative control: the check can fail
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    return undefined_name\n")
    done = _ruff(bad)
    assert done.returncode != 0 and "undefined_name" in done.stdout, done.stdout
