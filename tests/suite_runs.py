"""The matrix suites as tests run them: a tiny matrix's settings on the CPU (`TINY`; `SWEPT`, the same with a
sweep and three plans), `pytest suites/` on a matrix in a subprocess (`run_suite`), what it printed about its
failures (`why`), and the rows of its results file (`result_rows`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from poros.harness.matrix import parse_matrix

REPO = Path(__file__).resolve().parents[1]
TINY = dict(name="t", steps=2, passes=2, warmup_passes=1, seq_len=64, batch_size=1, grad_accum=1, lora_rank=4,
            lora_alpha=8, block_size=2, dataset="synthetic", device="cpu", stacks=["current"])


SWEPT = {**{k: v for k, v in TINY.items() if k != "grad_accum"}, "steps": 1, "passes": 1, "methods": ["poros", "resident"], "models": ["tiny-qwen3"],
         "sweep": {"grad_accum": [1, 2]}, "plans": {"streamed": {}, "b1": {"block_size": 1}, "b3": {"block_size": 3}}}


def plugin_env(tmp_path, name: str, source: str, **extra_env: str) -> dict:
    """`source` written as the pytest plugin module `name` in `tmp_path`; returns the environment whose PYTHONPATH
    finds it (for `run_suite(..., "-p", name, env=...)`), with `extra_env` set."""
    import os

    (tmp_path / f"{name}.py").write_text(source)
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **extra_env}


def run_suite(tmp_path, matrix: dict, *extra, env=None):
    path = tmp_path / "m.yaml"
    import yaml

    path.write_text(yaml.safe_dump(matrix))
    parse_matrix(matrix)  # the fixture itself must be valid
    results = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "pytest", str(REPO / "suites"), f"--matrix={path}", f"--results={results}",
           "-q", "-p", "no:cacheprovider", "-rsfE", *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    return proc, results


def why(proc: subprocess.CompletedProcess, tail: int = 1500) -> str:
    """What a suite subprocess printed about its failures, for an assertion's message: pytest's summary lines of
    failed and erroring tests and the first error lines (`E ...`), then the tail of its output."""
    lines = proc.stdout.splitlines()
    summary = [x for x in lines if x.startswith(("FAILED ", "ERROR "))]
    errors = [x for x in lines if x.startswith("E ")][:30]
    return "\n".join([*summary, *errors, "--- tail:", proc.stdout[-tail:], proc.stderr[-tail:]])


def result_rows(results: Path) -> list[dict]:
    return [json.loads(x) for x in results.read_text().splitlines()]
