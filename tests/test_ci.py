"""CI (.ci/run) runs README's Quick start test command on a pinned stack (constraints/ci.txt: every package at the
version the committed CPU page ran) and holds its CPU page to the committed one."""

from __future__ import annotations

import json
import re
from pathlib import Path

from poros.harness.report.layout import load_manifest

ROOT = Path(__file__).resolve().parents[1]
CI = (ROOT / ".ci" / "run").read_text()
README = (ROOT / "README.md").read_text()
CPU_ROWS = next(p for p in load_manifest(ROOT) if p.name == "cpu").rows_files(Path("."))[0]  # CI's stack's rows


def quick_start() -> list[str]:
    """The command lines of README's Quick start block."""
    block = README.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def pinned() -> dict[str, str]:
    lines = [x.strip() for x in (ROOT / "constraints" / "ci.txt").read_text().splitlines()]
    return {n.lower().replace("_", "-"): v for n, v in (x.split("==") for x in lines if x and not x.startswith("#"))}


def test_ci_runs_the_quick_start_test_command():
    line = CI.split("# README Quick start, line 2 (keep identical):\n", 1)[1].splitlines()[0]
    assert quick_start()[1] == line
    assert all("pip install -c constraints/ci.txt torch==2.13.0 " in x for x in quick_start())


def test_the_ci_stack_is_the_committed_cpu_page_s():
    """Each package the committed CPU rows name is pinned at the version they ran; torch at their version (its CPU
    build is the one pip finds on CI's machine, and the page check refuses any other)."""
    rows_file = CPU_ROWS
    versions = {(k, v) for line in (ROOT / rows_file).read_text().splitlines()
                for k, v in json.loads(line)["provenance"]["versions"].items() if v and k != "poros"}
    fixed = pinned()
    assert {k: fixed.get(k) for k, _ in versions} == {k: v.partition("+")[0] for k, v in versions}
    assert {"pytest-benchmark", "pytest-xdist", "numpy", "huggingface-hub", "tokenizers"} <= set(fixed)


def test_ci_holds_its_cpu_page_to_the_committed_one():
    rows_file = CPU_ROWS
    matrix = re.search(r"poros bench matrix matrices/cpu\.yaml -o (\S+)", CI).group(1)
    assert f"poros report {matrix}/results.jsonl -o {matrix}/cpu.md --check-against {rows_file}" in CI
