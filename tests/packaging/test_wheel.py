"""The package is the product: a wheel (not the source tree) runs the main job. Built here, installed into a
fresh virtual environment that sees this one's dependencies but not the checkout, and run from a folder outside
the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of the checkout's tracked files, built from a copy (a build leaves build/ where it runs)."""
    src, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        path = REPO / name
        if path.is_file() or path.is_symlink():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name, follow_symlinks=False)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True)
    (built,) = out.glob("poros-*.whl")
    return built


def test_the_wheel_ships_what_the_main_job_reads(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"poros/suites/test_matrix.py", "poros/suites/plugin.py", "poros/suites/pytest.ini",
            "poros/matrices/cpu.yaml", "poros/matrices/h200.yaml", "poros/harness/report/official.csv"} <= names
    assert not any(n.startswith(("tests/", "results/", "experiments/")) for n in names)


@pytest.mark.slow  # a CPU matrix cell end to end in a subprocess
def test_an_installed_wheel_runs_a_matrix_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # this environment's dependencies, behind the wheel: a .pth line adds the folder without reading its
    # own .pth files, so an editable install of the checkout stays out of sight
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run([str(py), "-c", "import poros; print(poros.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), f"poros was imported from {where}, not from the wheel"
    proc = subprocess.run([str(py), "-m", "poros", "bench", "matrix", "cpu", "-o", "out", "--steps", "1", "--passes",
                           "1", "-k", "tiny-qwen2"], cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (work / "out" / "report.md").read_text()
    assert "| tiny-qwen2 |" in report and "PASS" in report
