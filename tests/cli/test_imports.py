"""Commands that only read, plan from flags or show help load neither torch nor transformers: each runs in a
fresh interpreter, which then names the heavy modules it holds. `poros env`, which reports torch's build,
is the negative control: the same probe sees torch there."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness.test_report import cpu_row, write_jsonl

HEAVY = ("torch", "transformers")
PROBE = f"""
import json, runpy, sys
sys.argv = ["poros", *sys.argv[1:]]
try:
    runpy.run_module("poros", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as e:
    code = e.code
held = sorted(m for m in {HEAVY!r} if m in sys.modules)
print("LOADED " + json.dumps({{"exit": code, "heavy": held}}), file=sys.stderr)
"""


def loaded(*argv: str, cwd) -> dict:
    """`poros ARGV` in a fresh interpreter: its exit status and the heavy modules it imported."""
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=cwd)
    said = [line for line in done.stderr.splitlines() if line.startswith("LOADED ")]
    assert said, done.stderr[-2000:]
    return json.loads(said[-1].removeprefix("LOADED "))


@pytest.mark.parametrize("argv", [["--help"], ["report", "--help"], ["validate", "--help"], ["plan", "--help"],
                                  ["docs", "--help"]],
                         ids=lambda a: "argv=" + " ".join(a))
def test_help_loads_no_torch(argv, tmp_path):
    assert loaded(*argv, cwd=tmp_path) == {"exit": 0, "heavy": []}


def test_a_report_renders_without_torch(tmp_path):
    rows = write_jsonl(tmp_path / "rows.jsonl", [cpu_row(method="poros"), cpu_row(method="resident")])
    assert loaded("report", rows, "-o", str(tmp_path / "page.md"), cwd=tmp_path) == {"exit": 0, "heavy": []}
    assert "| qwen2.5-32b |" in (tmp_path / "page.md").read_text()


def test_the_probe_sees_a_command_that_loads_torch(tmp_path):
    got = loaded("env", cwd=tmp_path)
    assert got["exit"] == 0 and "torch" in got["heavy"]
